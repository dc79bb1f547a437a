"""``RateLimitedLog``: a logging filter that lets no one condition flood the log.

A client can make the server warn per request or per connection (a refused connection, a bad
request line, an exception in a route, ``accept()`` out of descriptors); at most ``burst``
warnings or errors of one kind (logger, level and message template) pass per ``window`` seconds, and the first record after a quiet spell says how
many were dropped. Installed on the handlers ``kvplug serve`` configures, never process-wide
on loggers other code owns.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

DEFAULT_BURST = 20
DEFAULT_WINDOW_S = 10.0


class RateLimitedLog(logging.Filter):
    """Args:
    burst: records of one kind let through per window.
    window: seconds.
    clock: monotonic seconds (tests pass their own).
    level_from: records below this level (info: the access log) all pass.
    """

    def __init__(
        self, burst: int = DEFAULT_BURST, window: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic,
        level_from: int = logging.WARNING,
    ) -> None:
        super().__init__()
        self.level_from = level_from
        self.burst = burst
        self.window = window
        self._clock = clock
        self._seen: dict[tuple, list] = {}  # kind -> [window start, passed, dropped]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level_from:
            return True  # per-request lines (the access log) are as many as the requests served
        kind = (record.name, record.levelno, str(record.msg)[:200])
        now = self._clock()
        with self._lock:
            entry = self._seen.get(kind)
            if entry is None or now - entry[0] >= self.window:
                dropped = entry[2] if entry is not None else 0
                if len(self._seen) > 10_000:  # many distinct messages: forget the old windows
                    self._seen.clear()
                self._seen[kind] = [now, 1, 0]
                if dropped:
                    record.msg = f"{record.msg} [{dropped} similar message(s) suppressed in the last {self.window:g} s]"
                return True
            if entry[1] < self.burst:
                entry[1] += 1
                return True
            entry[2] += 1
            return False
