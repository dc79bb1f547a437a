"""``python tests/serve_with_faulty_cache.py FAULT serve --prefix-cache faulty ...``: ``kvplug serve``
with the fault-injecting prefix cache of ``tests.faulty_cache`` registered as ``faulty`` (issue 32),
misbehaving as FAULT (``method:behaviour``) from the ``after``-th call on (``KVPLUG_TEST_FAULT_AFTER``,
default 2). Nothing in kvplug itself is changed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvplug  # noqa: E402
from kvplug.cli import main  # noqa: E402
from kvplug.plugins import default_manager  # noqa: E402
from tests.faulty_cache import FaultyCache  # noqa: E402


class ServedFaultyCachePlugin:
    def __init__(self, fault: str, after: int) -> None:
        self.fault, self.after = fault, after

    @kvplug.hookimpl
    def kvplug_register_prefix_caches(self, register):
        def factory(config):
            import dataclasses

            options = {"fault": self.fault, "after": self.after, **dict(config.options)}
            return FaultyCache(dataclasses.replace(config, options=options))

        register("faulty", factory)


def with_plugin(manager_class, plugin):
    """``manager_class`` whose new managers have ``plugin`` (``kvplug serve`` validates names with one)."""

    def build(*args, **kwargs):
        manager = manager_class(*args, **kwargs)
        manager.register(plugin, "faulty-cache-served")
        return manager

    return build


if __name__ == "__main__":
    import kvplug.cli.serve as serve_cli

    plugin = ServedFaultyCachePlugin(sys.argv[1], int(os.environ.get("KVPLUG_TEST_FAULT_AFTER", "2")))
    default_manager().register(plugin, "faulty-cache-served")  # what create_backend builds with
    serve_cli.PluginManager = with_plugin(serve_cli.PluginManager, plugin)
    sys.exit(main(sys.argv[2:]))
