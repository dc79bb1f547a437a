"""The paged allocator: hands out whole pages, records them token by token in the page table.

The free list holds the first token location of every free page (docs/design.md, section 1 "Paged allocation").
Growing a request from ``allocated_len`` to ``device_len`` takes pages ``allocated_len / P ..
ceil(device_len / P)``; a batch's pages are expanded to token locations and written into the page
table in one scattered write. In decode only requests crossing a page boundary grow, by one page
each: one numpy pass finds them and their pages go straight to their page-sized table slots.
``take_decode_pages`` does the same for a staged decode step but returns the pages instead of
writing them: the step's staging launch writes them (on a GPU host an upload, an add and a
scatter, 25-54 us of host time, half a step). On shortage the prefix cache evicts the missing
pages; when even that cannot cover the batch, ``OutOfMemoryError`` is raised before anything
changes.

Giving pages back: a finished request's computed page-aligned prefix goes into the prefix cache
(``cache_request``); a prefix the cache already holds (another request inserted it meanwhile)
leaves duplicate pages behind, which are freed; every other page goes to the free list. Frees
may be batched with ``lazy_free`` so a scheduling step concatenates the free list once.

Host-memory tier (a ``BaseTieredPrefixCache``): ``open_request`` also takes device pages for the
host-resident part of a match and starts the cache's load into them (see ``_match_and_load``). The
copy runs behind the compute stream; the request's *pending loads* (its own, and any still in
flight that its match reaches) are kept by row until ``order_loads`` orders them before the first
forward over the row (``KVBackend.prepare`` / ``begin_decode`` call it), or until they complete
(``loads_ready``, which a scheduler polls to keep the request out of its batches meanwhile), or
until the request finishes (its pages may be handed out again). A load that cannot get pages, or
whose copy fails, is skipped: the request computes those tokens and nothing is lost.

Who owns a page at any moment (``check_integrity`` verifies it): the free list, the prefix cache
(evictable or locked), or exactly one live request (pages past its locked prefix).
"""

from __future__ import annotations

import contextlib
import logging
from typing import NamedTuple, Sequence

import numpy as np
import torch

from kvplug.interface import (
    BaseCacheHandle,
    BasePrefixCache,
    BaseTieredPrefixCache,
    HostLoad,
    InvalidArgumentError,
    OutOfMemoryError,
    TierCopyError,
)
from kvplug.memory.free_list import FreeList
from kvplug.memory.integrity import check_allocator
from kvplug.memory.page_table import PageTable
from kvplug.memory.ragged import HostInts, expand_pages, host_ints
from kvplug.memory.request import Request, RequestStates

logger = logging.getLogger(__name__)


class NewPages(NamedTuple):
    """Pages a decode step's requests take, from the free list, not yet in the page table (the
    staging launch writes each at its request's cached length).

    Attributes:
        page_slot: shape ``[bs]``, int32, host; per request, the index in ``storage`` of its new
            page's first location, or -1 when it takes none.
        storage: int32, device; the free list's tensor the pages were taken from (kept alive here).
    """

    page_slot: np.ndarray
    storage: torch.Tensor


class PagedAllocator:
    """Page allocation, decode pages for a staging launch, prefix caching of finished work, and
    conservation checks (see the module docstring).

    Args:
        num_pages: pages that can be handed out (the pool's, dummy page excluded).
        page_size: tokens per page.
        page_table: the table rows are written into; its device is the allocator's.
        prefix_cache: where finished prefixes go and where evictions come from (same page size).

    Attributes:
        states: per-row lengths of live requests (``Request`` objects are views of it).
        evicted_tokens: tokens evicted from the prefix cache so far.
        tiered: the prefix cache has a host-memory tier (``BaseTieredPrefixCache``).
        host_hit_tokens: tokens loaded from the host tier into admitted requests so far.
        skipped_load_tokens: host-resident tokens matched but computed instead (no pages, or a
            failed copy).
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
        self._no_page_slots: dict[int, np.ndarray] = {}
        self._loads: dict[int, tuple[HostLoad, ...]] = {}  # row -> loads to order before its forwards
        self.evicted_tokens = 0
        self.host_hit_tokens = 0
        self.skipped_load_tokens = 0
        self.tiered = isinstance(prefix_cache, BaseTieredPrefixCache)

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
        if row in self._live:
            raise InvalidArgumentError(f"row {row} already belongs to a live request")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
            raise InvalidArgumentError(f"input_ids must be a 1-D int32 tensor, got {input_ids!r:.80}")
        n = int(input_ids.shape[0])
        if not 1 <= n <= self.page_table.max_seq_len:
            raise InvalidArgumentError(f"a request needs 1 to max_seq_len={self.page_table.max_seq_len} tokens, got {n}")
        self.page_table.check_row(row, allow_dummy=False)
        if self.tiered:
            handle = self._match_and_load(input_ids[: n - 1])
            loads = self.prefix_cache.loads_in_flight(handle)
            if loads:
                self._loads[row] = loads
        else:
            handle = self.prefix_cache.match_prefix(input_ids[: n - 1]).handle
            self.prefix_cache.lock_handle(handle)
        matched = int(handle.cached_len)
        self.page_table.write_tokens(row, 0, input_ids)
        if matched:
            self.page_table.write_locations(row, 0, handle.get_matched_indices())
        request = Request(self.states, row, n, matched, handle)
        self._live[row] = request
        return request

    def _match_and_load(self, input_ids: torch.Tensor) -> BaseCacheHandle:
        """Match against a tiered cache and start loading the host-resident part into device pages
        taken now (evicting as ``allocate`` would); returns the locked handle of what is on the
        device (in the cache's bookkeeping: the copy may still run, see ``loads_in_flight``).

        The host part is locked while pages are made for it (evicting writes other prefixes back
        and may drop host-resident ones: never these). Without pages, or when the copy fails,
        the request keeps the device-resident match and computes the rest.
        """
        cache = self.prefix_cache
        match = cache.match_tiered(input_ids)
        handle = match.handle
        cache.lock_handle(handle)
        host_len = int(match.host_len)
        if not host_len:
            return handle
        cache.lock_handle(match.host_handle)
        try:
            pages = self._take_pages(host_len // self.page_size, 1)
        except OutOfMemoryError:
            cache.lock_handle(match.host_handle, unlock=True)
            self.skipped_load_tokens += host_len
            return handle
        try:
            cache.start_host_load(match.host_handle, expand_pages(pages, self.page_size))
        except TierCopyError as error:
            logger.warning("kvplug host tier: a load failed (%s); the request computes those %d tokens",
                           error, host_len)
            self.free_list.release(pages.clone(), immediately=True)
            cache.lock_handle(match.host_handle, unlock=True)
            self.skipped_load_tokens += host_len
            return handle
        cache.lock_handle(handle, unlock=True)
        self.host_hit_tokens += host_len
        return match.host_handle

    # ------------------------------------------------------------------ pending loads
    @property
    def has_pending_loads(self) -> bool:
        """Some live request's pages may still be copying from host memory."""
        return bool(self._loads)

    def loads_ready(self, request: Request) -> bool:
        """Whether ``request``'s pages have all arrived (a forward over it would not wait for a
        copy). A scheduler keeps the request out of its batches until then; never blocks."""
        loads = self._loads.get(request.row)
        if loads is None:
            return True
        if not all(load.ready() for load in loads):
            return False
        del self._loads[request.row]  # complete: nothing left to order
        return True

    def order_loads(self, rows: np.ndarray) -> None:
        """Order every pending load of ``rows`` (shape ``[bs]``, int64, host) before what is queued
        next on the current stream: call it before the forward over them. No host wait."""
        loads = self._loads
        if not loads:
            return
        batch = set(rows.tolist())
        for row in [row for row in loads if row in batch]:
            for load in loads.pop(row):
                load.order_before()

    def wait_for_loads(self) -> None:
        """Block until every pending load has completed (a scheduler with nothing else to run)."""
        for loads in self._loads.values():
            for load in loads:
                load.synchronize()

    def allocate(self, requests: Sequence[Request], new_device_lens: HostInts | None = None) -> np.ndarray:
        """Set each request's ``device_len`` (default: its ``num_tokens``) and give it the pages
        that takes, in one table write. Returns the requests' rows (``states.batch_rows``).

        Evicts from the prefix cache when the free list is short. Raises ``OutOfMemoryError``
        (saying how many pages were needed and how many are available) or
        ``InvalidArgumentError`` with nothing changed.
        """
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
            if growing.size != rows.size:
                self._grow(rows[growing], row_starts[growing], allocated[growing], growth[growing])
            else:
                self._grow(rows, row_starts, allocated, growth)
        states.device_len[rows] = lengths
        return rows

    def take_decode_pages(self, rows: np.ndarray, cached: np.ndarray) -> NewPages | None:
        """A decode step's pages, taken but not written: each request whose new token (at
        ``cached[i]``) starts a page gets one, and its ``allocated_len`` grows by a page; the
        caller's staging launch writes them into the table (``DecodeStager.stage``). ``None``
        when no request crosses a page boundary.

        Args:
            rows: shape ``[bs]``, int64, host; live rows (``states.batch_rows``).
            cached: shape ``[bs]``, int64, host; their cached lengths, each with exactly one
                known token after it (the caller checked), so ``allocated_len >= cached`` and
                a request grows iff ``allocated_len == cached``.

        Raises ``OutOfMemoryError`` with nothing changed.
        """
        allocated = self.states.allocated_len[rows]
        growing = (allocated == cached).nonzero()[0]
        count = int(growing.size)
        if not count:
            return None
        self._make_room(count, count)
        storage, start = self.free_list.take_positions(count)
        if count == rows.size:  # every request starts a page (page size 1: every step)
            page_slot = np.arange(start, start + count, dtype=np.int32)
            self.states.allocated_len[rows] = allocated + self.page_size
        else:
            page_slot = self._page_slots_template(rows.size).copy()
            page_slot[growing] = np.arange(start, start + count, dtype=np.int32)
            self.states.allocated_len[rows[growing]] = allocated[growing] + self.page_size
        return NewPages(page_slot, storage)

    def write_decode_pages(self, rows: np.ndarray, cached: np.ndarray, pages: NewPages) -> None:
        """Write ``take_decode_pages``' pages into the table here (a caller without a staging
        launch): each at its request's cached length (``rows``, ``cached`` as given there)."""
        growing = (pages.page_slot >= 0).nonzero()[0]
        slots = torch.from_numpy(pages.page_slot[growing].astype(np.int64)).to(self.device)
        self._write_pages(rows[growing] * self.page_table.row_width + cached[growing], pages.storage[slots])

    def _page_slots_template(self, size: int) -> np.ndarray:
        """shape ``[size]``, int32, host, all -1 (read-only; a copy is cheaper than ``np.full``)."""
        template = self._no_page_slots.get(size)
        if template is None:
            template = self._no_page_slots[size] = np.full(size, -1, dtype=np.int32)
            template.flags.writeable = False
        return template

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

    # ------------------------------------------------------------------ giving pages back
    def cache_request(self, request: Request, *, finished: bool) -> None:
        """Move ``request``'s computed page-aligned prefix into the prefix cache.

        The cache may already hold part of it (another request inserted it meanwhile): those
        duplicate pages are freed. Unfinished (between prefill chunks): the request keeps its
        tail pages, locks the new handle and its row is pointed at the cache's pages.
        Finished: every page the cache did not take goes back to the free list and the request
        stops being live (its row is the caller's to free).
        """
        self.check_live(request)
        size, row = self.page_size, request.row
        aligned = request.cached_len // size * size
        old_handle = request.handle
        token_ids = self.page_table.read_tokens(row, 0, aligned)
        # the cache may keep the tensor it is given; the row itself will be overwritten later
        locations = self.page_table.locations(row, 0, aligned).clone()
        result = self.prefix_cache.insert_prefix(token_ids, locations)
        new_handle = result.handle
        if not finished:  # issue 32 seam: every cache call before the first free, so a fault changes nothing
            self.prefix_cache.lock_handle(new_handle)
        self.prefix_cache.lock_handle(old_handle, unlock=True)
        old_len = int(old_handle.cached_len)
        duplicate_end = max(int(result.cached_len), old_len)
        self.free_list.release(locations[old_len:duplicate_end:size])
        if finished:
            for load in self._loads.pop(row, ()):  # its pages go back to the pool: later users wait for the copy
                load.order_before()
            kept_end = max(duplicate_end, int(new_handle.cached_len))
            self.free_list.release(self._owned_page_starts(request, kept_end))
            request.handle = None
            request.finished = True
            request._detach()
            del self._live[row]
            return
        if duplicate_end > old_len:
            cached = new_handle.get_matched_indices()[old_len:duplicate_end]
            self.page_table.write_locations(row, old_len, cached)
        request.handle = new_handle

    def check_live(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"expected a kvplug Request, got {type(request).__name__}")
        if request.finished or self._live.get(request.row) is not request:
            raise InvalidArgumentError(f"request in row {request.row} is not live (finished, or not from this allocator)")

    def lazy_free(self) -> contextlib.AbstractContextManager[None]:
        """Collect frees made inside the block and apply them at its end (one concatenation per
        scheduling step). Pages freed inside are not allocatable until the outermost block exits."""
        return self.free_list.lazy()

    def _owned_page_starts(self, request: Request, begin: int) -> torch.Tensor:
        """First locations of the pages ``request`` owns from token ``begin`` (page-aligned) on."""
        end = min(request.allocated_len, self.page_table.row_width)
        return self.page_table.table[request.row, begin:end:self.page_size]

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless every page has exactly one owner (see module docstring)."""
        check_allocator(self, self.free_list.snapshot(include_pending=True))
