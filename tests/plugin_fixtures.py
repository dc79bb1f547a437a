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


def make_distribution(root: Path, distribution: str, version: str, entry_point: str, module: str, source: str) -> None:
    """Write ``module.py`` and a ``<distribution>-<version>.dist-info`` declaring one kvplug entry point."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    dist_info = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (dist_info / "entry_points.txt").write_text(f"[kvplug]\n{entry_point} = {module}\n")
