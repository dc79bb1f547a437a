"""``faulty-tiered`` (``tests.faulty_tiered_cache.FaultyTieredCache``) as an installed plugin would
register it, for server processes the tests cannot reach into (``kvplug serve`` and SGLang's
scheduler): ``write_distribution(site)`` declares this module in a ``kvplug`` entry point (a
``.dist-info`` to put on ``PYTHONPATH``). The fault comes from ``KVPLUG_TEST_FAULT``
(``method:behaviour``, default ``none``) and ``KVPLUG_TEST_FAULT_AFTER`` (default 2), which every
process of the server inherits; ``host_memory`` from the host's own flag."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import kvplug

DISTRIBUTION = "kvplug-test-faulty-tiered-cache"


@kvplug.hookimpl
def kvplug_register_prefix_caches(register):
    def factory(config):
        from tests.faulty_tiered_cache import FaultyTieredCache

        options = {
            "fault": os.environ.get("KVPLUG_TEST_FAULT", "none"),
            "after": int(os.environ.get("KVPLUG_TEST_FAULT_AFTER", "2")),
            **dict(config.options),
        }
        return FaultyTieredCache(dataclasses.replace(config, options=options))

    register("faulty-tiered", factory)


def write_distribution(site: Path) -> Path:
    """A ``.dist-info`` in ``site`` whose ``kvplug`` entry point ``faulty-tiered`` is this module
    (the repository root must be on ``PYTHONPATH`` too); returns ``site``."""
    info = site / f"{DISTRIBUTION.replace('-', '_')}-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[kvplug]\nfaulty-tiered = tests.faulty_tiered_cache_entry\n")
    return site
