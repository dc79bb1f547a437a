"""``PendingLoads``: the host-tier copies one admitted request must order before its pages are read.

Why an object: an admission that hits the host-memory tier (``PagedAllocator.open_request``)
starts copies into device pages and returns before they complete, so the request owes one act
of ordering: before the first forward over its row (``order_loads``, from ``KVBackend.prepare`` /
``begin_decode``), or before its pages go back to the pool (its ``finish``) - or none, once the
copies are known complete (``loads_ready``). That debt is this object, made by the admission and
kept by the allocator under the request's row until exactly one of those calls takes it. Taking
it twice would order copies a later request's pages no longer depend on, and taking it for
another request (a reused row) would skip the copies the new one does depend on, so both raise
``DeferredWorkError`` naming what was expected and what was given, with nothing changed.
"""

from __future__ import annotations

from kvplug.interface import DeferredWorkError, HostLoad

__all__ = ["PendingLoads"]


class PendingLoads:
    """The loads one request's admission left in flight (its own, and any its match reaches).

    Attributes:
        row: the request's row.
        key: the request's key (``RequestTable.key``), which tells it from a later one in the row.
        loads: the ``HostLoad`` objects, not known complete at admission.
    """

    __slots__ = ("row", "key", "loads", "_taken")

    def __init__(self, row: int, key: int, loads: tuple[HostLoad, ...]) -> None:
        self.row = row
        self.key = key
        self.loads = loads
        self._taken = False

    @property
    def taken(self) -> bool:
        return self._taken

    def ready(self) -> bool:
        """Every copy has completed (a forward over the row would not wait); never blocks."""
        return all(load.ready() for load in self.loads)

    def synchronize(self) -> None:
        """Block until every copy has completed (it stays to be taken)."""
        for load in self.loads:
            load.synchronize()

    def check(self, row: int, key: int) -> None:
        """``DeferredWorkError`` unless ``take(row, key)`` would succeed; changes nothing."""
        if self._taken:
            raise DeferredWorkError(
                f"expected the pending loads of the request in row {row} (key {key}), got ones taken already "
                f"(row {self.row}, key {self.key}, {len(self.loads)} loads): they are ordered once"
            )
        if row != self.row or key != self.key:
            raise DeferredWorkError(
                f"expected the pending loads of the request in row {row} (key {key}), got another request's "
                f"(row {self.row}, key {self.key}, {len(self.loads)} loads); nothing was ordered"
            )

    def take(self, row: int, key: int) -> tuple[HostLoad, ...]:
        """The loads, for the call that orders them (or found them complete); taken after."""
        self.check(row, key)
        self._taken = True
        return self.loads
