"""``RateLimitedLog``: no one kind of log record floods the log (issue 33 item 3)."""

from __future__ import annotations

import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug_transformers.log_limits import RateLimitedLog


def _record(msg: str, name: str = "asyncio", level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_a_burst_passes_then_the_rest_is_counted_and_reported():
    now = [0.0]
    limit = RateLimitedLog(burst=3, window=10.0, clock=lambda: now[0])
    passed = [limit.filter(_record("socket.accept() out of system resource")) for _ in range(1000)]
    assert passed == [True] * 3 + [False] * 997
    assert limit.filter(_record("another message"))  # other kinds are not held back
    assert all(limit.filter(_record("GET /health", "uvicorn.access", logging.INFO)) for _ in range(100))
    now[0] = 10.0
    record = _record("socket.accept() out of system resource")
    assert limit.filter(record) and "997 similar message(s) suppressed" in record.getMessage()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.floats(0, 5)), max_size=300))
def test_never_more_than_burst_per_kind_and_window(events):
    """Differential: at most ``burst`` records of a kind pass in any window that starts where
    one of its records opened a window."""
    now = [0.0]
    limit = RateLimitedLog(burst=4, window=10.0, clock=lambda: now[0])
    windows: dict[str, list] = {}
    for kind, step in events:
        now[0] += step
        passed = limit.filter(_record(kind))
        start, count = windows.get(kind, (None, 0))
        if start is None or now[0] - start >= 10.0:
            assert passed
            windows[kind] = (now[0], 1)
        else:
            assert passed == (count < 4)
            windows[kind] = (start, count + passed)
