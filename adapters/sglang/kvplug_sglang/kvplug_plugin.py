"""The ``kvplug`` entry point of kvplug-sglang: registers the host named ``"sglang"``.

Loaded whenever a ``kvplug.PluginManager`` starts, so it imports nothing from SGLang.
"""

from __future__ import annotations

from typing import Any

from kvplug import hookimpl

HOST_NAME = "sglang"


def create_host(**options: Any):
    """``PluginManager().create("host", "sglang", prefix_cache=..., attention=...)``."""
    from kvplug_sglang.host import SGLangHost

    return SGLangHost(**options)


@hookimpl
def kvplug_register_hosts(register):
    register(HOST_NAME, create_host)
