"""The paged allocator: hands out whole pages, records them token by token in the page table.

Everything here is host bookkeeping: the free list, the page table's host arrays and the prefix
cache are host data, so no call waits for the device; the device tables learn of new locations
through the page table's one staged write per step (``PageTable.flush``).

The free list holds the first token location of every free page (docs/design.md, section 1
"Paged allocation"). Growing a request from ``allocated_len`` to ``device_len`` takes pages
``allocated_len / P .. ceil(device_len / P)``. In decode only requests crossing a page boundary
grow, by one page each: ``take_decode_pages`` finds them and returns their pages for the step's
staging launch, which writes them on the device. On shortage the prefix cache evicts the missing
pages; when even that cannot cover the batch, ``OutOfMemoryError`` is raised before anything
changes.

Giving pages back: a finished request's computed, host-known, page-aligned prefix goes into the
prefix cache (``cache_request``); a prefix the cache already holds (another request inserted it
meanwhile) leaves duplicate pages behind, which are freed; every other page goes to the free list.
Frees may be batched with ``lazy_free`` so pages given back during a scheduling step are not
handed out again within it: the region owns them as a ``DeferredFrees`` (``deferred_frees``).

Host-memory tier (a ``BaseTieredPrefixCache``): ``open_request`` also takes device pages for the
host-resident part of a match and starts the cache's load into them (see ``_match_and_load``). The
copy runs behind the compute stream; the request's *pending loads* (its own, and any still in
flight that its match reaches) are one ``PendingLoads`` object the admission makes, kept under the
row and taken once (``_take_loads``) by the first of: ``order_loads``, which orders them before the
first forward over the row (``KVBackend.prepare`` / ``begin_decode`` call it); ``loads_ready``,
finding them complete; the request's finish (its pages may be handed out again). A load that
cannot get pages, or whose copy fails, is skipped: the request computes those tokens.

The free list (``FreeList``) is host data: the first location of each free page in one int32
numpy array; allocation advances a head index, frees are appended behind the free part, and
inside a lazy region frees go into the region's ``DeferredFrees``, appended by ``FreeList.apply``
when the outermost region exits.

Who owns a page at any moment (``check_integrity`` verifies it): the free list, the prefix cache
(evictable or locked), or exactly one live request (pages past its locked prefix).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, NamedTuple, Sequence

import numpy as np
import torch

from kvplug.interface import (
    BaseCacheHandle,
    BasePrefixCache,
    BaseTieredPrefixCache,
    DeferredWorkError,
    HostLoad,
    InvalidArgumentError,
    MatchResult,
    OutOfMemoryError,
    TierCopyError,
)
from kvplug.memory.deferred_frees import DeferredFrees
from kvplug.memory.integrity import check_allocator
from kvplug.memory.page_table import PageTable
from kvplug.memory.pending_loads import PendingLoads
from kvplug.memory.ragged import HostInts, host_ints
from kvplug.memory.request import Request, RequestTable
from kvplug.prefix_cache.host_arrays import HostArrayCalls, host_view

logger = logging.getLogger(__name__)


class FreeList:
    """Free pages of a pool of ``num_pages`` pages of ``page_size`` tokens (all free at start)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        # the free pages are self._free[self._head:]; arrays handed out by take() are never
        # written again (release builds a new array), so they stay valid
        self._free = np.arange(num_pages, dtype=np.int32) * np.int32(page_size)
        self._head = 0
        self._deferred: DeferredFrees | None = None  # the open lazy region's frees (its object, not a list here)

    def __len__(self) -> int:
        """Pages that can be taken now (pending lazy frees excluded)."""
        return self._free.shape[0] - self._head

    @property
    def num_pending(self) -> int:
        """Pages freed inside the current lazy region, not yet takeable."""
        return self._deferred.num_pages if self._deferred is not None else 0

    @property
    def deferred(self) -> DeferredFrees | None:
        """The open lazy region's frees, ``None`` outside a region."""
        return self._deferred

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
        if self._deferred is not None and not immediately:
            self._deferred.add(page_starts)
        else:
            self._free = np.concatenate([self._free[self._head :], page_starts.astype(np.int32, copy=False)])
            self._free.flags.writeable = False
            self._head = 0

    @contextlib.contextmanager
    def lazy(self) -> Iterator[DeferredFrees]:
        """Defer frees until the outermost ``lazy`` block exits (also on an exception: the frees
        were real); yields the region's ``DeferredFrees`` (a nested block, the outer one's)."""
        if self._deferred is not None:
            yield self._deferred
            return
        self._deferred = deferred = DeferredFrees()
        try:
            yield deferred
        finally:
            self.apply(deferred)

    def apply(self, deferred: DeferredFrees) -> None:
        """Release ``deferred``, the open region's frees: its pages become takeable. Once:
        ``DeferredWorkError`` (nothing changed) for frees released already or not this list's."""
        if deferred is not self._deferred:
            raise DeferredWorkError(
                "expected the frees of this free list's open lazy region, got "
                + (f"ones released already ({deferred.num_pages} pages)" if deferred.taken
                   else f"ones it did not open ({deferred.num_pages} pages)")
            )
        batches = deferred.take()
        self._deferred = None
        if batches:
            self._free = np.concatenate([self._free[self._head :], *batches])
            self._free.flags.writeable = False
            self._head = 0

    def snapshot(self, *, include_pending: bool = False) -> np.ndarray:
        """A copy of the free pages (and, if asked, the pending ones): shape ``[f]``, int32, host."""
        free = self._free[self._head :]
        if include_pending and self._deferred is not None:
            return np.concatenate([free, self._deferred.pages()])
        return free.copy()


class NewPages(NamedTuple):
    """Pages a decode step's requests take from the free list, not yet on the device (the
    staging launch writes each at its request's cached length).

    Attributes:
        page_start: shape ``[bs]``, int32, host; per request, the first location of its new
            page, or -1 when it takes none.
    """

    page_start: np.ndarray


class PrefixLookup(NamedTuple):
    """What ``PagedAllocator.lookup`` found for a prompt, unlocked: an opaque result a host may
    look at (``cached_len``) before it admits the prompt with it, so the prompt is matched once.

    Attributes:
        input_ids: shape ``[n]``, int32, cpu; the prompt.
        cached_len: tokens the admission would find cached (on the device, plus those a tiered
            cache holds in host memory).
        match: the cache's ``MatchResult`` (a ``TieredMatchResult`` for a tiered cache).
        epoch: the allocator's cache epoch when it was made; an admission after the cache
            changed matches again.
    """

    input_ids: torch.Tensor
    cached_len: int
    match: object
    epoch: int


class PagedAllocator:
    """Page allocation, decode pages for a staging launch, prefix caching of finished work, and
    conservation checks (see the module docstring).

    Args:
        num_pages: pages that can be handed out (the pool's, dummy page excluded).
        page_size: tokens per page.
        page_table: the table rows are written into.
        prefix_cache: where finished prefixes go and where evictions come from (same page size;
            host data: it is given and returns CPU tensors).

    Attributes:
        states: the ``RequestTable`` (``Request`` objects are views of it).
        evicted_tokens: tokens evicted from the prefix cache so far.
        tiered: the prefix cache has a host-memory tier (``BaseTieredPrefixCache``).
        host_arrays: the prefix cache is a built-in one that takes host arrays (``HostArrayCalls``):
            ids and locations go to it as numpy arrays, evictions come back as one.
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
        self.states = RequestTable(page_table.max_running_reqs, page_table.row_width)
        self.free_list = FreeList(num_pages, page_size)
        self._no_pages: dict[int, np.ndarray] = {}
        # NOTE: the page size as a read-only 0-d int64 array for per-step sums: numpy handles an
        # array operand faster than a Python int, whose dtype it works out on every call
        self._page_step = np.array(page_size, dtype=np.int64)
        self._page_step.flags.writeable = False
        self._loads: dict[int, PendingLoads] = {}  # row -> its admission's loads, until one call takes them
        self.evicted_tokens = 0
        self.host_hit_tokens = 0
        self.skipped_load_tokens = 0
        self.tiered = isinstance(prefix_cache, BaseTieredPrefixCache)
        self.host_arrays = isinstance(prefix_cache, HostArrayCalls)  # a built-in cache: host arrays in and out
        # NOTE: bumped by every call that may change what the cache matches (insert, evict,
        # a load), so a PrefixLookup made before it is matched again instead of trusted
        self._epoch = 0

    def replace_cache(self, cache: BasePrefixCache) -> None:
        """Use ``cache`` from now on (a hand-over: ``kvplug.cache_guard``); earlier lookups are stale."""
        self.prefix_cache = cache
        self.tiered = isinstance(cache, BaseTieredPrefixCache)
        self.host_arrays = isinstance(cache, HostArrayCalls)
        self._epoch += 1

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
        """A copy of the free list: shape ``[num_free_pages]``, int32, cpu, multiples of page_size."""
        return torch.from_numpy(self.free_list.snapshot())

    @property
    def live_requests(self) -> list[Request]:
        return self.states.live_requests

    # ------------------------------------------------------------------ request lifecycle
    def lookup(self, input_ids: torch.Tensor) -> PrefixLookup:
        """Match ``input_ids`` (shape ``[n]``, int32, cpu; ``n >= 1``) without locking or
        changing anything: at most ``n - 1`` tokens, as ``open_request`` would."""
        query_len = self._check_prompt(input_ids) - 1
        if self.tiered:
            match = self.prefix_cache.match_tiered(input_ids[:query_len])
            cached = int(match.handle.cached_len) + int(match.host_len)
        else:
            match = self._match(input_ids, query_len)
            cached = int(match.handle.cached_len)
        return PrefixLookup(input_ids, cached, match, self._epoch)

    def _match(self, input_ids: torch.Tensor, query_len: int) -> MatchResult:
        """``prefix_cache.match_prefix(input_ids[:query_len])``, through ``match_host`` where the
        cache takes host arrays and ``input_ids`` (checked by ``_check_prompt``) reads in place."""
        if self.host_arrays:
            ids = host_view(input_ids)
            if ids is not None:
                return MatchResult(self.prefix_cache.match_host(ids[:query_len]))
        return self.prefix_cache.match_prefix(input_ids[:query_len])

    def open_request(self, row: int, input_ids: torch.Tensor | PrefixLookup, *, match: bool = True) -> Request:
        """Match the prompt against the prefix cache, lock the match, point the row at it and
        write the ids into the row's tokens (host now, device at the next flush).

        At most ``len(input_ids) - 1`` tokens are matched, so the first forward computes at least
        one token (the one whose logits sample the next token).

        Args:
            row: a free request row.
            input_ids: shape ``[n]``, int32, cpu; ``1 <= n <= max_seq_len``; or a
                ``PrefixLookup`` of the prompt (its match is used while the cache is unchanged).
            match: ``False`` admits without a lookup (the host just found nothing cached).
        """
        lookup = input_ids if isinstance(input_ids, PrefixLookup) else None
        if lookup is not None:
            input_ids = lookup.input_ids
            if lookup.epoch != self._epoch:
                lookup = None  # the cache changed since: match again
        n = self._check_prompt(input_ids)
        self.page_table.check_row(row, allow_dummy=False)
        if self.states.key[row] >= 0:
            raise InvalidArgumentError(f"row {row} already belongs to a live request")
        query_len = n - 1 if match else 0
        cache = self.prefix_cache
        if self.tiered:
            handle = self._match_and_load(input_ids[:query_len] if lookup is None else None,
                                          lookup.match if lookup else None)
        else:
            if lookup is not None:
                handle = lookup.match.handle
            elif self.host_arrays and (ids := host_view(input_ids)) is not None:
                handle = cache.match_host(ids[:query_len])  # a numpy slice: cheaper than the tensor's
            else:
                handle = cache.match_prefix(input_ids[:query_len]).handle
            cache.lock_handle(handle)
        matched = int(handle.cached_len)
        try:
            locations = handle.get_matched_indices() if matched else None
            if locations is not None and (not isinstance(locations, torch.Tensor) or locations.device.type != "cpu"):
                raise InvalidArgumentError(
                    f"prefix cache {type(cache).__name__} returned matched indices on "
                    f"{getattr(locations, 'device', type(locations).__name__)}; prefix caches keep host data (cpu)"
                )
            self.page_table.write_tokens(row, 0, input_ids)
            if locations is not None:
                self.page_table.write_locations(row, 0, locations)
        except BaseException:
            cache.lock_handle(handle, unlock=True)
            raise
        loads = cache.loads_in_flight(handle) if self.tiered else ()
        request = self.states.open(row, n, matched, handle)
        if loads:
            self._loads[row] = PendingLoads(row, request.key, loads)
        return request

    def _check_prompt(self, input_ids: object) -> int:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or input_ids.dtype != torch.int32 \
                or input_ids.device.type != "cpu":
            raise InvalidArgumentError(f"input_ids must be a 1-D int32 CPU tensor, got {input_ids!r:.80}")
        n = int(input_ids.shape[0])
        if not 1 <= n <= self.page_table.max_seq_len:
            raise InvalidArgumentError(f"a request needs 1 to max_seq_len={self.page_table.max_seq_len} tokens, got {n}")
        return n

    def _match_and_load(self, input_ids: torch.Tensor | None, match: object = None) -> BaseCacheHandle:
        """Match against a tiered cache and start loading the host-resident part into device pages
        taken now (evicting as ``allocate`` would); returns the locked handle of what is on the
        device (in the cache's bookkeeping: the copy may still run, see ``loads_in_flight``).

        The host part is locked while pages are made for it (evicting writes other prefixes back
        and may drop host-resident ones: never these). Without pages, or when the copy fails,
        the request keeps the device-resident match and computes the rest.
        """
        cache = self.prefix_cache
        if match is None:
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
        self._epoch += 1  # loading makes host-resident nodes device-resident
        try:
            cache.start_host_load(match.host_handle, torch.from_numpy(_expand(pages, self.page_size)))
        except TierCopyError as error:
            logger.warning("kvplug host tier: a load failed (%s); the request computes those %d tokens",
                           error, host_len)
            self.free_list.release(pages, immediately=True)
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

    def pending_loads(self, request: Request) -> PendingLoads | None:
        """The ``PendingLoads`` ``request``'s admission made, while not taken (``None``: none)."""
        return self._loads.get(request.row) if self.states.is_live(request) else None

    def loads_ready(self, request: Request) -> bool:
        """Whether ``request``'s pages have all arrived (a forward over it would not wait for a
        copy): its pending loads are then taken, with nothing left to order. A scheduler keeps
        the request out of its batches until then; never blocks."""
        pending = self._loads.get(request.row)
        if pending is None:
            return True
        if not pending.ready():
            return False
        self._take_loads([request.row])
        return True

    def order_loads(self, rows: np.ndarray) -> None:
        """Take the pending loads of ``rows`` (shape ``[bs]``, int64, host) and order them before
        what is queued next on the current stream: call it before the forward over them. No
        host wait."""
        loads = self._loads
        if not loads:
            return
        batch = set(rows.tolist())
        for load in self._take_loads([row for row in loads if row in batch]):
            load.order_before()

    def _take_loads(self, rows: Sequence[int]) -> list[HostLoad]:
        """The one taker of pending loads: ``rows``' objects, checked against the rows' live
        requests first (``DeferredWorkError``, nothing taken), then taken and dropped."""
        loads, keys = self._loads, self.states.key
        for row in rows:
            loads[row].check(row, int(keys[row]))
        taken: list[HostLoad] = []
        for row in rows:
            taken.extend(loads.pop(row).take(row, int(keys[row])))
        return taken

    def wait_for_loads(self) -> None:
        """Block until every pending load has completed (a scheduler with nothing else to run):
        the one documented wait of the tier. The loads stay to be taken."""
        for pending in self._loads.values():
            pending.synchronize()

    def allocate(self, requests: Sequence[Request], new_device_lens: HostInts | None = None) -> np.ndarray:
        """Set each request's ``device_len`` (default: its ``num_tokens``) and give it the pages
        that takes. Returns the requests' rows (``states.batch_rows``).

        Evicts from the prefix cache when the free list is short. Raises ``OutOfMemoryError``
        (saying how many pages were needed and how many are available) or
        ``InvalidArgumentError`` with nothing changed.
        """
        states = self.states
        rows = states.batch_rows(requests).rows
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
        growing = (lengths > allocated).nonzero()[0]
        if growing.size:
            grow_rows = rows[growing]
            needs = -(-(lengths[growing] - allocated[growing]) // self.page_size)
            pages = self._take_pages(int(needs.sum()), int(grow_rows.size))
            self.page_table.write_row_pages(grow_rows, allocated[growing], needs, pages, self.page_size)
            states.reserve(grow_rows, allocated[growing] + needs * self.page_size)
        states.schedule(rows, lengths)
        return rows

    def take_decode_pages(self, rows: np.ndarray, cached: np.ndarray, cells: np.ndarray) -> NewPages | None:
        """A decode step's pages, taken but not written on the device: each request whose new
        token (at ``cached[i]``) starts a page gets one (noted in the host table), and its
        ``allocated_len`` grows by a page; the caller's staging launch writes them into the
        device table (``DecodeStager.stage``). ``None`` when no request crosses a page boundary.

        Args:
            rows: shape ``[bs]``, int64, host; live rows (``states.batch_rows``).
            cached: shape ``[bs]``, int64, host; their cached lengths, each with exactly one
                known token after it (the caller checked), so ``allocated_len >= cached`` and
                a request grows iff ``allocated_len == cached``.
            cells: shape ``[bs]``, int64, host; ``rows * row_width + cached``.

        Raises ``OutOfMemoryError`` with nothing changed.
        """
        states = self.states
        growing = (states.allocated_len[rows] == cached).nonzero()[0]
        count = growing.size
        if not count:
            return None
        pages = self._take_pages(count, count)  # read-only: the free list never writes it again
        if count == rows.size:  # every request starts a page (page size 1: every step)
            self.page_table.record_decode_pages(cells, pages, self.page_size)
            states.reserve(rows, cached + self._page_step)
            return NewPages(pages)
        page_start = self._no_pages_template(rows.size).copy()
        page_start[growing] = pages
        self.page_table.record_decode_pages(cells[growing], pages, self.page_size)
        states.reserve(rows[growing], cached[growing] + self._page_step)
        return NewPages(page_start)

    def _no_pages_template(self, size: int) -> np.ndarray:
        """shape ``[size]``, int32, host, all -1 (read-only; a copy is cheaper than ``np.full``)."""
        template = self._no_pages.get(size)
        if template is None:
            template = self._no_pages[size] = np.full(size, -1, dtype=np.int32)
            template.flags.writeable = False
        return template

    def mark_computed(self, requests: Sequence[Request]) -> None:
        """The forward over ``requests`` ran: their K/V up to ``device_len`` is in the pool."""
        self.states.computed(self.states.rows_of(requests))

    # ------------------------------------------------------------------ internals
    def _take_pages(self, count: int, num_requests: int) -> np.ndarray:
        try:  # the free list checks its length itself
            return self.free_list.take(count)
        except OutOfMemoryError:  # short: evict from the prefix cache (or raise, nothing changed)
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
            self._epoch += 1
            if self.host_arrays:
                locations = self.prefix_cache.evict_host(shortage * self.page_size)
            else:
                evicted = self.prefix_cache.evict(shortage * self.page_size)
                if not isinstance(evicted, torch.Tensor) or evicted.device.type != "cpu":
                    raise InvalidArgumentError(
                        f"prefix cache {type(self.prefix_cache).__name__}.evict returned "
                        f"{getattr(evicted, 'device', type(evicted).__name__)}; prefix caches keep host data (cpu)"
                    )
                locations = evicted.numpy()
            self.evicted_tokens += int(locations.shape[0])
            # a cache holds whole pages, so each evicted page shows up once by its first location
            self.free_list.release(locations[locations % self.page_size == 0], immediately=True)

    # ------------------------------------------------------------------ giving pages back
    def cache_request(self, request: Request, *, finished: bool) -> None:
        """Move ``request``'s computed page-aligned prefix (as far as the host knows its ids)
        into the prefix cache.

        The cache may already hold part of it (another request inserted it meanwhile): those
        duplicate pages are freed. Unfinished (between prefill chunks): the request keeps its
        tail pages, locks the new handle and its row is pointed at the cache's pages.
        Finished: every page the cache did not take goes back to the free list and the request
        ends (its row is free).
        """
        self.check_live(request)
        size, row, table = self.page_size, request.row, self.page_table
        aligned = min(request.cached_len, request.known_len) // size * size
        old_handle = request.handle
        self._epoch += 1
        if self.host_arrays:  # views: the cache reads them during the call and keeps nothing
            locations = table.host_locations(row, 0, aligned)
            cached_len, new_handle = self.prefix_cache.insert_host(table.host_token_ids(row, 0, aligned), locations)
        else:  # copies: the cache may keep the tensors it is given, and the row will be rewritten
            token_ids = torch.from_numpy(table.host_token_ids(row, 0, aligned).copy())
            locations = table.host_locations(row, 0, aligned).copy()
            result = self.prefix_cache.insert_prefix(token_ids, torch.from_numpy(locations))
            cached_len, new_handle = result.cached_len, result.handle
        # every cache call before the first free, so a fault of the cache changes nothing here
        if not finished:
            self.prefix_cache.lock_handle(new_handle)
        self.prefix_cache.lock_handle(old_handle, unlock=True)
        old_len = int(old_handle.cached_len)
        duplicate_end = max(int(cached_len), old_len)
        kept_end = max(duplicate_end, int(new_handle.cached_len))
        shared = None
        if not finished and duplicate_end > old_len:
            shared = new_handle.get_matched_indices()[old_len:duplicate_end]
        if finished and row in self._loads:  # its pages go back to the pool: later users wait for the copy
            for load in self._take_loads([row]):
                load.order_before()
        self.free_list.release(locations[old_len:duplicate_end:size])
        if finished:
            end = min(request.allocated_len, table.row_width)
            self.free_list.release(table.host_locations(row, kept_end, end)[::size])
            self.states.close(request)
            return
        if shared is not None:
            table.write_locations(row, old_len, shared)
        self.states.rehandle(request, new_handle)

    def check_live(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"expected a kvplug Request, got {type(request).__name__}")
        if not self.states.is_live(request):
            raise InvalidArgumentError(f"request in row {request.row} is not live (finished, or not from this allocator)")

    def lazy_free(self) -> contextlib.AbstractContextManager[DeferredFrees]:
        """Collect frees made inside the block and apply them at its end. Pages freed inside
        are not allocatable until the outermost block exits; yields their ``DeferredFrees``."""
        return self.free_list.lazy()

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless every page has exactly one owner (see module docstring)."""
        self.states.check_integrity()
        check_allocator(self, self.free_list.snapshot(include_pending=True))


def _expand(page_starts: np.ndarray, page_size: int) -> np.ndarray:
    """Token locations of whole pages: shape ``[len * page_size]``, int32, host."""
    if page_size == 1:
        return np.array(page_starts, dtype=np.int32)  # a copy: the free list's arrays are read-only
    return (page_starts[:, None] + np.arange(page_size, dtype=np.int32)).reshape(-1)
