"""``kvplug_sglang.compat.INTERNALS``: every SGLang internal in the table still has the fingerprint
pinned for 0.5.23 in the installed SGLang (a release that renames a parameter, changes
``/health``'s handler or drops a name is named here). Runs in the SGLang test environment."""

from __future__ import annotations

import dataclasses

from tests.sglang_helpers import import_sglang

import_sglang()

from kvplug import host_internals  # noqa: E402
from kvplug_sglang import compat  # noqa: E402


def test_every_pinned_sglang_internal_is_unchanged():
    assert host_internals.drifted(compat.INTERNALS) == [], host_internals.drift_lines(
        host_internals.drifted(compat.INTERNALS))


def test_a_changed_internal_is_seen():
    entry = compat.INTERNALS[0]
    changed = dataclasses.replace(entry, fingerprint="self, server_args")
    gone = dataclasses.replace(entry, attribute="no_such_method")
    found = dict((e.attribute, now) for e, now in host_internals.drifted((changed, gone)))
    assert found == {"__init__": "self, server_args, port_args, start_pd_bootstrap_service", "no_such_method": "missing"}
