"""The ``kvplug`` entry point of this distribution: registers the host named ``"transformers"``.

Loaded every time a ``kvplug.PluginManager`` starts, so it imports nothing heavy: transformers
is imported (and its version checked) only when the host is created.
"""

from __future__ import annotations

from typing import Any

from kvplug import hookimpl

HOST_NAME = "transformers"


def create_host(**options: Any):
    """``PluginManager().create("host", "transformers", **options)``: a ``TransformersHost``
    whose default settings are ``options`` (see ``kvplug_transformers.KVPlugSettings``)."""
    from kvplug_transformers.host import TransformersHost

    return TransformersHost(**options)


@hookimpl
def kvplug_register_hosts(register):
    register(HOST_NAME, create_host)
