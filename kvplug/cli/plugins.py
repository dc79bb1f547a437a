"""``kvplug plugins [--json]``: every registered plugin, built-ins included.

JSON output (stable, versioned by ``schema``)::

    {"schema": 1, "kvplug_version": "...", "interface_version": 1,
     "plugins": [{"name": str, "distribution": str, "version": str, "file": str | null,
                  "builtin": bool, "provides": {kind: [name, ...]}}],
     "load_failures": [{"entry_point": str, "distribution": str, "version": str, "error": str}]}

``kind`` is one of ``prefix_cache``, ``kv_pool``, ``attention``, ``host``.
"""

from __future__ import annotations

import argparse
import json
import warnings

from kvplug._version import __version__
from kvplug.interface import INTERFACE_VERSION
from kvplug.plugins import PluginManager
from kvplug.plugins.loading import PluginLoadWarning

JSON_SCHEMA_VERSION = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plugins", help="list plugins and the components they provide")
    parser.add_argument("--json", action="store_true", help="machine-readable output (documented schema)")
    parser.set_defaults(handler=run)


def report(manager: PluginManager) -> dict:
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
                "error": f"{type(failure.error).__name__}: {failure.error}",
            }
            for failure in manager.load_failures
        ],
    }


def run(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():
        # failures are reported in the output itself; under --json stderr stays clean
        if args.json:
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
        print(f"failed: {failure['entry_point']} ({failure['distribution']} {failure['version']}): {failure['error']}")
    return 0
