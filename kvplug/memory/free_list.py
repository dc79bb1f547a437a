"""The free list of pages, on the host, with a lazy-free region.

Pages are named by their first token location (a multiple of the page size), held in one int32
numpy array: the allocator decides which pages a request gets without asking the device, and the
device learns of them through the page table's staged writes. Allocation takes from the front by
advancing a head index; frees are appended behind the free part. Inside a lazy region (one
scheduling step) frees are collected and appended when the outermost region exits, so pages a
finishing request gives back are not handed out again within the same step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

from kvplug.interface import OutOfMemoryError


class FreeList:
    """Free pages of a pool of ``num_pages`` pages of ``page_size`` tokens (all free at start)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        # the free pages are self._free[self._head:]; arrays handed out by take() are never
        # written again (release builds a new array), so they stay valid
        self._free = np.arange(num_pages, dtype=np.int32) * np.int32(page_size)
        self._head = 0
        self._pending: list[np.ndarray] = []
        self._lazy_depth = 0

    def __len__(self) -> int:
        """Pages that can be taken now (pending lazy frees excluded)."""
        return self._free.shape[0] - self._head

    @property
    def num_pending(self) -> int:
        """Pages freed inside the current lazy region, not yet takeable."""
        return sum(int(pages.shape[0]) for pages in self._pending)

    def take(self, count: int) -> np.ndarray:
        """Remove and return the first ``count`` pages: shape ``[count]``, int32, host (read-only)."""
        if count > self._free.shape[0] - self._head:
            raise OutOfMemoryError(f"cannot take {count} pages: {len(self)} free, {self.num_pending} pending lazy frees")
        head = self._head
        self._head = head + count
        return self._free[head : head + count]

    def release(self, page_starts: np.ndarray, *, immediately: bool = False) -> None:
        """Give pages back (``page_starts``: shape ``[n]``, int32, host); deferred inside a lazy
        region unless ``immediately`` (evicted pages, taken right away by the allocation that
        evicted them). The array is copied: the caller may reuse it."""
        if page_starts.size == 0:
            return
        if self._lazy_depth and not immediately:
            self._pending.append(np.array(page_starts, dtype=np.int32))
        else:
            self._free = np.concatenate([self._free[self._head :], page_starts.astype(np.int32, copy=False)])
            self._free.flags.writeable = False
            self._head = 0

    @contextlib.contextmanager
    def lazy(self) -> Iterator[None]:
        """Defer frees until the outermost ``lazy`` block exits (also on an exception: the frees
        were real)."""
        self._lazy_depth += 1
        try:
            yield
        finally:
            self._lazy_depth -= 1
            if self._lazy_depth == 0 and self._pending:
                self._free = np.concatenate([self._free[self._head :], *self._pending])
                self._free.flags.writeable = False
                self._head = 0
                self._pending.clear()

    def snapshot(self, *, include_pending: bool = False) -> np.ndarray:
        """A copy of the free pages (and, if asked, the pending ones): shape ``[f]``, int32, host."""
        free = self._free[self._head :]
        if include_pending:
            return np.concatenate([free, *self._pending])
        return free.copy()
