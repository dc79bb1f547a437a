"""The free list of pages, with a lazy-free region.

Pages are named by their first token location (a multiple of the page size), held in one int32
tensor on the pool's device. Allocation takes from the front by advancing a head index (one slice
per allocation); frees are appended behind the free part, dropping the taken front. Inside a lazy
region (one scheduling step) frees are collected and concatenated once when the outermost region
exits, so finishing many requests costs one concatenation instead of one per request.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from kvplug.interface import OutOfMemoryError


class FreeList:
    """Free pages of a pool of ``num_pages`` pages of ``page_size`` tokens (all free at start)."""

    def __init__(self, num_pages: int, page_size: int, device: torch.device) -> None:
        # the free pages are self._free[self._head:]
        self._free = torch.arange(num_pages, dtype=torch.int32, device=device) * page_size
        self._head = 0
        self._pending: list[torch.Tensor] = []
        self._lazy_depth = 0

    def __len__(self) -> int:
        """Pages that can be taken now (pending lazy frees excluded)."""
        return self._free.shape[0] - self._head

    @property
    def num_pending(self) -> int:
        """Pages freed inside the current lazy region, not yet takeable."""
        return sum(int(pages.shape[0]) for pages in self._pending)

    def take(self, count: int) -> torch.Tensor:
        """Remove and return the first ``count`` pages: shape ``[count]``, int32, device."""
        if count > self._free.shape[0] - self._head:
            raise OutOfMemoryError(f"cannot take {count} pages: {len(self)} free, {self.num_pending} pending lazy frees")
        head = self._head
        self._head = head + count
        return self._free[head : head + count]

    def take_positions(self, count: int) -> tuple[torch.Tensor, int]:
        """``take(count)`` without making the slice: ``(storage, start)`` where the pages are
        ``storage[start : start + count]`` (``storage``: int32, device; it stays valid while
        referenced, even after later frees replace the list's own tensor)."""
        if count > self._free.shape[0] - self._head:
            raise OutOfMemoryError(f"cannot take {count} pages: {len(self)} free, {self.num_pending} pending lazy frees")
        head = self._head
        self._head = head + count
        return self._free, head

    def release(self, page_starts: torch.Tensor, *, immediately: bool = False) -> None:
        """Give pages back (``page_starts``: shape ``[n]``, int32, device); deferred inside a lazy
        region unless ``immediately`` (evicted pages, taken right away by the allocation that
        evicted them)."""
        if page_starts.numel() == 0:
            return
        if self._lazy_depth and not immediately:
            # page_starts may view a table row that is reused before the region ends
            self._pending.append(page_starts.clone())
        else:
            self._free = torch.cat([self._free[self._head :], page_starts])
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
                self._free = torch.cat([self._free[self._head :], *self._pending])
                self._head = 0
                self._pending.clear()

    def snapshot(self, *, include_pending: bool = False) -> torch.Tensor:
        """A copy of the free pages (and, if asked, the pending ones): shape ``[f]``, int32, device."""
        free = self._free[self._head :]
        if include_pending:
            return torch.cat([free, *self._pending])
        return free.clone()
