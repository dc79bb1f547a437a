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
from _thread import get_ident
from typing import Any, Callable, NoReturn, TypeVar

from kvplug.interface import ConcurrentUseError, PrefixCacheFault

F = TypeVar("F", bound=Callable[..., Any])

#: Replacements tried for one call before its fault is raised (fallback, then ``naive``).
MAX_REPLACEMENTS = 2


class CallGate:
    """Which thread is inside a backend call now (``thread``: its ident, ``None``: none)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread: int | None = None

    def inside(self) -> bool:
        """Whether the current thread is inside a call (the backend is calling its cache)."""
        return self.thread == get_ident()

    def try_enter(self) -> bool:
        """Enter if no other thread is inside; ``False`` (nothing changed) when one is."""
        if not self.lock.acquire(blocking=False):
            return False
        self.thread = get_ident()
        return True

    def refuse(self, what: str) -> NoReturn:
        inside = self.thread
        name = next((thread.name for thread in threading.enumerate() if thread.ident == inside), str(inside))
        raise ConcurrentUseError(
            f"KVBackend.{what} was called from thread {threading.current_thread().name!r} while thread "
            f"{name!r} is inside another call: a backend is driven by one thread at a time (nothing was changed)"
        )

    def leave(self) -> None:
        self.thread = None
        self.lock.release()


def backend_call(method: F) -> F:
    """Run a ``KVBackend`` lifecycle method inside its gate and its prefix-cache guard."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        gate = self._gate
        ident = get_ident()
        if gate.thread == ident:  # the backend calling itself
            return method(self, *args, **kwargs)
        if not gate.lock.acquire(False):
            gate.refuse(name)
        gate.thread = ident
        try:
            if self.cache_guard.stopped is not None:
                self.cache_guard.check_running()
            try:
                return method(self, *args, **kwargs)
            except PrefixCacheFault as fault:
                return _recover_and_retry(self, method, name, fault, args, kwargs)
        finally:
            gate.thread = None
            gate.lock.release()

    return call  # type: ignore[return-value]


def _recover_and_retry(backend: Any, method: Callable, name: str, fault: PrefixCacheFault, args: tuple,
                       kwargs: dict) -> Any:
    """Replace the faulty cache and run the call again, up to ``MAX_REPLACEMENTS`` times."""
    for attempt in range(MAX_REPLACEMENTS):
        backend.cache_guard.recover(backend, fault, during=name)  # raises when the policy is "fail"
        try:
            return method(backend, *args, **kwargs)
        except PrefixCacheFault as again:
            if attempt == MAX_REPLACEMENTS - 1:
                raise
            fault = again
    raise AssertionError("unreachable")
