"""Builds fake installed distributions (dist-info + modules) in a directory, for entry-point tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

GOOD_PLUGIN = '''
import kvplug
from kvplug.prefix_cache.naive import NaivePrefixCache


@kvplug.hookimpl
def kvplug_register_prefix_caches(register):
    register("{cache_name}", NaivePrefixCache)
'''

BROKEN_PLUGIN = '''
raise RuntimeError("this plugin is broken on purpose")
'''

MISSPELT_PLUGIN = '''
import kvplug


@kvplug.hookimpl
def kvplug_register_prefix_caches(registr):
    registr("never", None)
'''


RAISING_HOOK_PLUGIN = '''
import kvplug


@kvplug.hookimpl
def kvplug_register_prefix_caches(register):
    raise RuntimeError("this hook is broken on purpose")
'''

EXIT_ON_IMPORT_PLUGIN = '''
import sys

sys.exit(3)
'''

EXIT_IN_HOOK_PLUGIN = '''
import sys

import kvplug


@kvplug.hookimpl
def kvplug_register_prefix_caches(register):
    register("exit-cache-never-kept", object)
    sys.exit("exiting from a hook on purpose")
'''

# Registers a good name first, then a colliding one: the good one must not stay registered either.
COLLIDING_PLUGIN = '''
import kvplug
from kvplug.prefix_cache.naive import NaivePrefixCache


@kvplug.hookimpl
def kvplug_register_prefix_caches(register):
    register("{cache_name}-own", NaivePrefixCache)
    register("{cache_name}", NaivePrefixCache)
'''

SOURCES = {
    "good": GOOD_PLUGIN,
    "broken": BROKEN_PLUGIN,
    "misspelt": MISSPELT_PLUGIN,
    "raising-hook": RAISING_HOOK_PLUGIN,
    "exit-on-import": EXIT_ON_IMPORT_PLUGIN,
    "exit-in-hook": EXIT_IN_HOOK_PLUGIN,
    "colliding": COLLIDING_PLUGIN,
}


def make_distribution(root: Path, distribution: str, version: str, entry_point: str, module: str, source: str) -> None:
    """Write ``module.py`` and a ``<distribution>-<version>.dist-info`` declaring one kvplug entry point."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    dist_info = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (dist_info / "entry_points.txt").write_text(f"[kvplug]\n{entry_point} = {module}\n")
