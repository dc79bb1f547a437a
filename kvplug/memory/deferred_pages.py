"""Decode-step page writes deferred to the step's staging launch (GPU tables).

In a decode step, ``allocate`` gives each request that crosses a page boundary one page. Writing
those pages into a GPU table costs an upload, an add and a scatter: 25-54 us of host time on the
H200 hosts, half the step. Deferred, they are written by ``DecodeStager``'s launch in the
``prepare`` that follows (which reads the table in that launch anyway).

Until then the table lacks those pages, so every other reader writes them first: the allocator
at its own entry points (``open_request``, ``allocate``, ``cache_request``, ``check_integrity``)
and ``KVBackend`` for anything but the decode ``prepare`` of the same requests. Only growth that
starts at each request's cached length is deferred (a decode step's: the staging launch writes at
``row * row_width + cached_len``); anything else is written at once.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class DeferredPages(NamedTuple):
    """One decode allocation's pages, taken from the free list but not yet in the table.

    Attributes:
        rows: the ``states.batch_rows`` array of that ``allocate`` (its identity names the batch).
        page_slot: shape ``[bs]``, int32, host; per request, the index in ``storage`` of its new
            page's first location, or -1 when it took none.
        storage: int32, device; the free list's tensor the pages were taken from (kept alive here).
        start, count: the pages are ``storage[start : start + count]``.
        first_cells: shape ``[count]``, int64, host; flat table cell of each new page's first
            location, in the order of ``storage``.
    """

    rows: np.ndarray
    page_slot: np.ndarray
    storage: torch.Tensor
    start: int
    count: int
    first_cells: np.ndarray

    @property
    def pages(self) -> torch.Tensor:
        """shape ``[count]``, int32, device: the pages' first token locations."""
        return self.storage[self.start : self.start + self.count]


class DeferredPageWrites:
    """The deferring half of ``PagedAllocator`` (a mixin; the allocator provides ``states``,
    ``free_list``, ``page_size``, ``_make_room`` and ``_write_pages``).

    Attributes:
        defer_decode_pages: defer decode growth (``KVBackend`` turns it on when its decode stager
            writes pages in its launch); off, every allocation is written at once.
    """

    defer_decode_pages = False
    _deferred: DeferredPages | None = None
    _page_slot_templates: dict | None = None

    def _defer_growth(
        self, rows: np.ndarray, growing: np.ndarray, grown_rows: np.ndarray, row_starts: np.ndarray,
        allocated: np.ndarray, growth: np.ndarray, *, checked: bool = False,
    ) -> bool:
        """Take one page for each growing request and defer its write, when this is a decode
        step's growth (one page each, from the cached length; ``checked``: the caller knows it
        is); returns whether it did (else nothing changed). ``rows``: the batch's; the rest:
        shape ``[g]``, int64, host, of the growing requests (``growing``: their indices in the
        batch)."""
        size = self.page_size
        if not checked and (np.count_nonzero(allocated - self.states.cached_len[grown_rows]) or growth.max() > size):
            return False
        count = int(grown_rows.size)
        self._make_room(count, count)
        storage, start = self.free_list.take_positions(count)
        page_slot = self._no_page_slots(rows.size).copy()
        page_slot[growing] = np.arange(start, start + count, dtype=np.int32)
        self._deferred = DeferredPages(rows, page_slot, storage, start, count, row_starts + allocated)
        self.states.allocated_len[grown_rows] = allocated + size
        return True

    def _no_page_slots(self, size: int) -> np.ndarray:
        """shape ``[size]``, int32, host, all -1 (read-only; a copy is cheaper than ``np.full``)."""
        if self._page_slot_templates is None:
            self._page_slot_templates = {}
        template = self._page_slot_templates.get(size)
        if template is None:
            template = self._page_slot_templates[size] = np.full(size, -1, dtype=np.int32)
            template.flags.writeable = False
        return template

    def flush_deferred_pages(self) -> None:
        """Write deferred pages into the table now (no-op when there are none)."""
        deferred = self._deferred
        if deferred is not None:
            self._deferred = None
            self._write_pages(deferred.first_cells, deferred.pages)

    def take_deferred_pages(self, rows: np.ndarray) -> DeferredPages | None:
        """Hand the deferred pages to the decode ``prepare`` of the batch whose ``batch_rows``
        array is ``rows`` (the caller then writes them); for any other batch write them now and
        return ``None``."""
        deferred = self._deferred
        if deferred is None:
            return None
        if deferred.rows is not rows:
            self.flush_deferred_pages()
            return None
        self._deferred = None
        return deferred
