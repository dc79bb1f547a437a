"""The paged allocator: hands out whole pages, records them token by token in the page table.

The free list holds the first token location of every free page (SPEC §1 "Paged allocation").
Growing a request from ``allocated_len`` to ``device_len`` takes pages ``allocated_len / P ..
ceil(device_len / P)``; a batch's pages are expanded to token locations and written into the page
table in one scattered write. In decode only requests crossing a page boundary grow, by one page
each: one numpy pass finds them and their pages go straight to their page-sized table slots. On
shortage the prefix cache evicts the missing pages; when even that cannot cover the batch,
``OutOfMemoryError`` is raised before anything changes. Giving pages back (a request's prefix
into the cache, its tail to the free list) is ``kvplug.memory.caching``.

Who owns a page at any moment (``check_integrity`` verifies it): the free list, the prefix cache
(evictable or locked), or exactly one live request (pages past its locked prefix).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvplug.interface import BasePrefixCache, InvalidArgumentError, OutOfMemoryError
from kvplug.memory.caching import PrefixCaching
from kvplug.memory.deferred_pages import DeferredPageWrites
from kvplug.memory.free_list import FreeList
from kvplug.memory.integrity import check_allocator
from kvplug.memory.page_table import PageTable
from kvplug.memory.ragged import HostInts, expand_pages, host_ints
from kvplug.memory.request import Request, RequestStates


class PagedAllocator(PrefixCaching, DeferredPageWrites):
    """Page allocation, prefix caching of finished work (``PrefixCaching``), decode page writes
    deferred to the staging launch (``DeferredPageWrites``), and conservation checks.

    Args:
        num_pages: pages that can be handed out (the pool's, dummy page excluded).
        page_size: tokens per page.
        page_table: the table rows are written into; its device is the allocator's.
        prefix_cache: where finished prefixes go and where evictions come from (same page size).

    Attributes:
        states: per-row lengths of live requests (``Request`` objects are views of it).
        evicted_tokens: tokens evicted from the prefix cache so far.
    """

    def __init__(self, num_pages: int, page_size: int, page_table: PageTable, prefix_cache: BasePrefixCache) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_table = page_table
        self.prefix_cache = prefix_cache
        self.device = page_table.device
        self.states = RequestStates(page_table.max_running_reqs, page_table.row_width)
        self.free_list = FreeList(num_pages, page_size, self.device)
        self._live: dict[int, Request] = {}
        self._page_offsets = np.arange(page_size, dtype=np.int64)
        self.evicted_tokens = 0

    # ------------------------------------------------------------------ sizes
    @property
    def num_free_pages(self) -> int:
        """Pages in the free list (pending lazy frees not included)."""
        return len(self.free_list)

    @property
    def num_evictable_pages(self) -> int:
        return self.prefix_cache.size_info.evictable_size // self.page_size

    @property
    def num_cached_pages(self) -> int:
        return self.prefix_cache.size_info.total_size // self.page_size

    @property
    def free_page_starts(self) -> torch.Tensor:
        """A copy of the free list: shape ``[num_free_pages]``, int32, device, multiples of page_size."""
        return self.free_list.snapshot()

    @property
    def live_requests(self) -> list[Request]:
        return list(self._live.values())

    # ------------------------------------------------------------------ request lifecycle
    def open_request(self, row: int, input_ids: torch.Tensor) -> Request:
        """Match ``input_ids`` against the prefix cache, lock the match, point the row at it and
        write ``input_ids`` into the row's token pool (``cache_request`` reads them back).

        At most ``len(input_ids) - 1`` tokens are matched, so the first forward computes at least
        one token (the one whose logits sample the next token).

        Args:
            row: a request row the caller owns (not live in this allocator).
            input_ids: shape ``[n]``, int32, device; ``1 <= n <= max_seq_len``.
        """
        self.flush_deferred_pages()
        if row in self._live:
            raise InvalidArgumentError(f"row {row} already belongs to a live request")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
            raise InvalidArgumentError(f"input_ids must be a 1-D int32 tensor, got {input_ids!r:.80}")
        n = int(input_ids.shape[0])
        if not 1 <= n <= self.page_table.max_seq_len:
            raise InvalidArgumentError(f"a request needs 1 to max_seq_len={self.page_table.max_seq_len} tokens, got {n}")
        self.page_table.check_row(row, allow_dummy=False)
        handle = self.prefix_cache.match_prefix(input_ids[: n - 1]).handle
        matched = int(handle.cached_len)
        self.prefix_cache.lock_handle(handle)
        self.page_table.write_tokens(row, 0, input_ids)
        if matched:
            self.page_table.write_locations(row, 0, handle.get_matched_indices())
        request = Request(self.states, row, n, matched, handle)
        self._live[row] = request
        return request

    def allocate(
        self, requests: Sequence[Request], new_device_lens: HostInts | None = None, *, decoding_rows: np.ndarray | None = None
    ) -> np.ndarray:
        """Set each request's ``device_len`` (default: its ``num_tokens``) and give it the pages
        that takes, in one table write. Returns the requests' rows (``states.batch_rows``).

        ``decoding_rows``: a ``batch_rows`` array the caller knows to hold ``num_tokens ==
        cached_len + 1`` for each of its requests (nothing changed them since an append); when
        it is this batch's, a decode step's growth needs no checks.

        Evicts from the prefix cache when the free list is short. Raises ``OutOfMemoryError``
        (saying how many pages were needed and how many are available) or
        ``InvalidArgumentError`` with nothing changed.
        """
        self.flush_deferred_pages()
        states = self.states
        rows, row_starts = states.batch_rows(requests)
        num_tokens = states.num_tokens[rows]
        lengths = num_tokens  # cached_len <= num_tokens always holds: nothing to check
        if new_device_lens is not None:
            lengths = host_ints(new_device_lens, "new_device_lens")
            if lengths.shape != rows.shape:
                raise InvalidArgumentError(
                    f"new_device_lens needs one length per request: {rows.size} requests, {lengths.size} lengths"
                )
            cached = states.cached_len[rows]
            bad = (lengths < cached) | (lengths > num_tokens)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise InvalidArgumentError(
                    f"request in row {rows[i]}: new device_len must lie in [cached_len={cached[i]}, "
                    f"num_tokens={num_tokens[i]}] (token ids known), got {lengths[i]}"
                )
        allocated = states.allocated_len[rows]
        growth = lengths - allocated
        # only requests growing past their last page need pages (in decode: about 1 in page_size)
        growing = (growth > 0).nonzero()[0]
        if growing.size:
            grown_rows, starts = rows, row_starts
            if growing.size != rows.size:
                grown_rows, starts, allocated, growth = rows[growing], row_starts[growing], allocated[growing], growth[growing]
            decoding = new_device_lens is None and rows is decoding_rows
            if not (
                self.defer_decode_pages
                and self._defer_growth(rows, growing, grown_rows, starts, allocated, growth, checked=decoding)
            ):
                self._grow(grown_rows, starts, allocated, growth)
        states.device_len[rows] = lengths
        return rows

    def _grow(self, rows: np.ndarray, row_starts: np.ndarray, allocated: np.ndarray, growth: np.ndarray) -> None:
        """Give each request row ``rows[i]`` (flat start ``row_starts[i]``) the pages that grow it
        from ``allocated[i]`` tokens (whole pages) by ``growth[i] >= 1`` tokens; all shape
        ``[g]``, int64, host. Raises ``OutOfMemoryError`` before changing anything."""
        size = self.page_size
        # flat table index of each request's first new cell (a page start)
        first_cells = row_starts + allocated
        if int(growth.max()) <= size:  # one new page each (decode)
            self._write_pages(first_cells, self._take_pages(int(rows.size), int(rows.size)))
            self.states.allocated_len[rows] = allocated + size
            return
        needs = -(-growth // size)
        total = int(needs.sum())
        pages = self._take_pages(total, int(rows.size))
        # new page k is page (k - share_begin) of its request's new pages
        share_begin = np.cumsum(needs) - needs
        page_cells = np.repeat(first_cells - share_begin * size, needs) + np.arange(0, total * size, size)
        self._write_pages(page_cells, pages)
        self.states.allocated_len[rows] = allocated + needs * size

    def mark_computed(self, requests: Sequence[Request]) -> None:
        """The forward over ``requests`` ran: their K/V up to ``device_len`` is in the pool."""
        rows = self.states.rows_of(requests)
        self.states.cached_len[rows] = self.states.device_len[rows]

    # ------------------------------------------------------------------ internals
    def _take_pages(self, count: int, num_requests: int) -> torch.Tensor:
        self._make_room(count, num_requests)
        return self.free_list.take(count)

    def _make_room(self, count: int, num_requests: int) -> None:
        """Evict from the prefix cache until ``count`` pages are free, or raise
        ``OutOfMemoryError`` (nothing changed) when even that cannot cover them."""
        shortage = count - len(self.free_list)
        if shortage > 0:
            evictable = self.num_evictable_pages
            if shortage > evictable:
                pending = self.free_list.num_pending
                raise OutOfMemoryError(
                    f"allocation for {num_requests} request(s) needs {count} pages of {self.page_size} tokens; "
                    f"available: {self.num_free_pages} free + {evictable} evictable from the prefix cache "
                    f"= {self.num_free_pages + evictable} (of {self.num_pages})"
                    + (f", plus {pending} pending lazy frees" if pending else "")
                )
            evicted = self.prefix_cache.evict(shortage * self.page_size)
            self.evicted_tokens += int(evicted.shape[0])
            # a cache holds whole pages, so each evicted page shows up once by its first location
            self.free_list.release(evicted[evicted % self.page_size == 0], immediately=True)

    def _write_pages(self, page_cells: np.ndarray, pages: torch.Tensor) -> None:
        """Record new pages in the table, in one scattered write.

        Args:
            page_cells: shape ``[n]``, int64, host; flat table index where each page's first
                location goes (``row * row_width + page number * page_size``).
            pages: shape ``[n]``, int32, device; first token locations of the pages.
        """
        size, width = self.page_size, self.page_table.row_width
        if size == 1:
            self.page_table.write_flat(self.page_table.table, page_cells, pages)
        elif width % size == 0:  # rows are whole pages: one page-sized slot per new page
            self.page_table.write_pages(page_cells // size, pages, size)
        else:
            # the last page of a request may reach past a row that page_size does not divide;
            # it is owned whole, but only columns inside the row are recorded
            inside = ((page_cells % width)[:, None] + self._page_offsets < width).reshape(-1)
            flat_index = (page_cells[:, None] + self._page_offsets).reshape(-1)[inside]
            locations = expand_pages(pages, size)
            self.page_table.write_flat(self.page_table.table, flat_index, locations[torch.from_numpy(inside).to(self.device)])

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless every page has exactly one owner (see module docstring)."""
        self.flush_deferred_pages()
        check_allocator(self, self.free_list.snapshot(include_pending=True))
