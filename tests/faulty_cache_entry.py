"""``faulty`` (``tests.faulty_cache.FaultyCache``) as an installed plugin would register it, for
server processes the tests cannot reach into: ``test_sglang_server_cache_faults.py`` declares this
module in a ``kvplug`` entry point (a ``.dist-info`` on ``PYTHONPATH``); the fault comes from
``KVPLUG_TEST_FAULT`` (``method:behaviour``) and ``KVPLUG_TEST_FAULT_AFTER`` (default 2), which
every SGLang process inherits."""

from __future__ import annotations

import dataclasses
import os

import kvplug
from tests.faulty_cache import FaultyCache


@kvplug.hookimpl
def kvplug_register_prefix_caches(register):
    def factory(config):
        options = {
            "fault": os.environ.get("KVPLUG_TEST_FAULT", "none"),
            "after": int(os.environ.get("KVPLUG_TEST_FAULT_AFTER", "2")),
            **dict(config.options),
        }
        return FaultyCache(dataclasses.replace(config, options=options))

    register("faulty", factory)
