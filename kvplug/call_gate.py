"""``CallGate``: a ``KVBackend`` is driven by one thread at a time; an overlapping call is refused.

The backend's state (free list, rows, lengths, the prefix cache) has one owner and no lock: a
host's scheduler thread drives it. Two threads calling at once would interleave half-done updates
(the 8-thread run of issue 32 took pages two calls had both counted as free). The gate makes that
a clear ``ConcurrentUseError`` instead: every lifecycle call enters it with a non-blocking lock
acquire, so a call from a second thread while one runs is refused before it changes anything.
Calls from different threads one after another are fine (a backend may be built on one thread and
driven by another). A call made inside another on the same thread (the backend calling itself)
passes through.

``backend_call`` is the decorator the lifecycle methods carry: the gate, then the prefix-cache
guard (``kvplug.cache_guard``): a ``PrefixCacheFault`` replaces the cache and the call runs again
on the replacement (each lifecycle call changes nothing before its cache calls succeeded).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, TypeVar

from kvplug.interface import ConcurrentUseError, PrefixCacheFault

F = TypeVar("F", bound=Callable[..., Any])

#: Replacements tried for one call before its fault is raised (fallback, then ``naive``).
MAX_REPLACEMENTS = 2


class CallGate:
    """Which thread is inside a backend call now (``None``: none)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.thread: int | None = None
        self.thread_name: str | None = None

    def inside(self) -> bool:
        """Whether the current thread is inside a call (the backend is calling its cache)."""
        return self.thread == threading.get_ident()

    def try_enter(self) -> bool:
        """Enter if no other thread is inside; ``False`` (nothing changed) when one is."""
        if not self._lock.acquire(blocking=False):
            return False
        self.thread = threading.get_ident()
        self.thread_name = threading.current_thread().name
        return True

    def enter(self, what: str) -> None:
        if not self.try_enter():
            raise ConcurrentUseError(
                f"KVBackend.{what} was called from thread {threading.current_thread().name!r} while thread "
                f"{self.thread_name!r} is inside another call: a backend is driven by one thread at a time "
                "(nothing was changed)"
            )

    def leave(self) -> None:
        self.thread = self.thread_name = None
        self._lock.release()


def backend_call(method: F) -> F:
    """Run a ``KVBackend`` lifecycle method inside its gate and its prefix-cache guard."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        gate = self._gate
        if gate.thread == threading.get_ident():  # the backend calling itself
            return method(self, *args, **kwargs)
        gate.enter(name)
        try:
            guard = self.cache_guard
            guard.check_running()
            for attempt in range(MAX_REPLACEMENTS + 1):
                try:
                    return method(self, *args, **kwargs)
                except PrefixCacheFault as fault:
                    if attempt == MAX_REPLACEMENTS:
                        raise
                    guard.recover(self, fault, during=name)  # raises when the policy is "fail"
        finally:
            gate.leave()

    return call  # type: ignore[return-value]
