"""Hands out page-table rows to requests and takes them back.

Rows ``0 .. max_running_reqs - 1`` belong to requests; the dummy row (``max_running_reqs``) is
never handed out. Freeing a row that is not live (double free, dummy row, out of range) raises
``InvalidArgumentError`` and changes nothing.
"""

from __future__ import annotations

from kvplug.interface import InvalidArgumentError, OutOfMemoryError


class RowManager:
    """Free-row bookkeeping for ``max_running_reqs`` request rows (host side only)."""

    def __init__(self, max_running_reqs: int) -> None:
        if isinstance(max_running_reqs, bool) or not isinstance(max_running_reqs, int) or max_running_reqs < 1:
            raise InvalidArgumentError(f"max_running_reqs must be a positive int, got {max_running_reqs!r}")
        self.max_running_reqs = max_running_reqs
        # a stack popped from the end: low rows first keeps the live part of the table compact
        self._free = list(range(max_running_reqs - 1, -1, -1))
        self._live: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def live_rows(self) -> frozenset[int]:
        return frozenset(self._live)

    def is_live(self, row: int) -> bool:
        return row in self._live

    def allocate(self) -> int:
        """A free row; ``OutOfMemoryError`` when all ``max_running_reqs`` rows are live."""
        if not self._free:
            raise OutOfMemoryError(
                f"no free page-table row: all max_running_reqs={self.max_running_reqs} rows are in use; "
                "finish a request first or raise max_running_reqs"
            )
        row = self._free.pop()
        self._live.add(row)
        return row

    def free(self, row: int) -> None:
        """Return a live row."""
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.max_running_reqs:
            raise InvalidArgumentError(
                f"row must be a request row, an int in [0, {self.max_running_reqs}), got {row!r}"
            )
        if row not in self._live:
            raise InvalidArgumentError(f"row {row} is not in use (double free?)")
        self._live.remove(row)
        self._free.append(row)

    def check_integrity(self) -> None:
        """Every request row is either free or live, exactly once."""
        assert len(self._free) == len(set(self._free)), "a row is free twice"
        assert not self._live.intersection(self._free), "a row is both free and live"
        assert len(self._free) + len(self._live) == self.max_running_reqs, "a row went missing"
