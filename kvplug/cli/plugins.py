"""``kvplug plugins [--json]``: every registered plugin, built-ins included.

JSON output (stable, versioned by ``schema``)::

    {"schema": 1, "kvplug_version": "...", "interface_version": 1,
     "plugins": [{"name": str, "distribution": str, "version": str, "file": str | null,
                  "builtin": bool, "provides": {kind: [name, ...]}}],
     "load_failures": [{"entry_point": str, "distribution": str, "version": str, "error": str}],
     "filtered_out": [{"entry_point": str, "distribution": str, "version": str, "why": str}]}

``kind`` is one of ``prefix_cache``, ``kv_pool``, ``attention``, ``host``, ``kv_store`` (issue 30). ``load_failures`` are
plugins that were skipped (failed to import, a hook raised or exited, a name collided with a
built-in or an earlier plugin); ``error`` is the reason in one line. ``filtered_out`` are installed
entry points that ``KVPLUG_LOAD_PLUGINS`` / ``KVPLUG_DISABLE_PLUGINS`` kept from loading (added
in kvplug 0.1; consumers of schema 1 must ignore keys they do not know). A skipped plugin never
makes the command fail: it exits 0 and lists the failure.
"""

from __future__ import annotations

import argparse
import json
import warnings

from kvplug._version import __version__
from kvplug.plugins import PluginManager
from kvplug.plugins.loading import PluginLoadWarning

JSON_SCHEMA_VERSION = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plugins", help="list plugins and the components they provide")
    parser.add_argument("--json", action="store_true", help="machine-readable output (documented schema)")
    parser.set_defaults(handler=run)


def report(manager: PluginManager) -> dict:
    from kvplug.interface import INTERFACE_VERSION  # imported late: the interface package imports torch today

    return {
        "schema": JSON_SCHEMA_VERSION,
        "kvplug_version": __version__,
        "interface_version": INTERFACE_VERSION,
        "plugins": [info.to_json() for info in manager.plugins()],
        "load_failures": [
            {
                "entry_point": failure.entry_point,
                "distribution": failure.distribution,
                "version": failure.version,
                "error": failure.reason,
            }
            for failure in manager.load_failures
        ],
        "filtered_out": [
            {
                "entry_point": filtered.entry_point,
                "distribution": filtered.distribution,
                "version": filtered.version,
                "why": filtered.why,
            }
            for filtered in manager.filtered_out
        ],
    }


def run(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():
        # failures are listed in the output itself, once
        warnings.simplefilter("ignore", PluginLoadWarning)
        manager = PluginManager()
    data = report(manager)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [("PLUGIN", "DISTRIBUTION", "VERSION", "PROVIDES", "FILE")]
    for plugin in data["plugins"]:
        provides = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in plugin["provides"].items()) or "-"
        rows.append((plugin["name"], plugin["distribution"], plugin["version"], provides, plugin["file"] or "-"))
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4])
    for failure in data["load_failures"]:
        print(
            f"skipped: {failure['entry_point']} ({failure['distribution']} {failure['version']}) failed to load: "
            f"{failure['error']}"
        )
    for filtered in data["filtered_out"]:
        origin = f"{filtered['distribution']} {filtered['version']}"
        print(f"not loaded: {filtered['entry_point']} ({origin}): {filtered['why']}")
    return 0
