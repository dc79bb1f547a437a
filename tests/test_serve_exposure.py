"""Which listen addresses ``kvplug serve`` treats as loopback: beyond them, starting without
``--api-key`` logs a warning (issue 33 item 6)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("example.org", False),
])
def test_loopback_addresses(host, loopback):
    pytest.importorskip("transformers")
    from kvplug_transformers.server import _is_loopback

    assert _is_loopback(host) is loopback
