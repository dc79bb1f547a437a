"""The facade a host engine talks to: ``kvplug.create_backend(...)`` -> ``KVBackend`` (docs/design.md, section 4).

One object owns the pool, page table + token pool, request table, paged allocator, prefix cache
and attention backend, and exposes the request lifecycle::

    request = backend.admit(prompt_ids)            # row, prefix match + lock, token ids (host)
    backend.allocate([request])                    # pages for every known token (atomic)
    batch = backend.prepare([request], "prefill")  # AttentionBatch + backend metadata
    input_ids = backend.input_ids(batch)           # on the device, from the token pool
    ... model forward; per layer: out = backend.forward(q, k, v, layer_id, batch)
    backend.append_tokens([request], next_ids)     # forward done; sampled id into the token pool
    step = backend.begin_decode(requests)          # decode: pages, batch, input ids in one call
    ... forward over step.batch (or graphs.run(step)); step.commit(next_ids); repeat
    backend.finish(request, tokens=host_ids)       # prefix into the cache, tail freed, row freed

Host first: every call but ``prepare`` / ``begin_decode`` / ``input_ids`` / ``forward`` is host
bookkeeping only (the request table, the free list, the page table's host arrays, the prefix
cache), so none of them waits for the device. The device tables get the host's writes in one
staged upload per step, made by ``prepare`` / ``begin_decode`` (``PageTable.flush``). The prefix
cache keys requests by token ids the host knows: the prompt, ids given as host values, and ids a
host reports with ``record_tokens`` or ``finish(..., tokens=)``; sampled ids that stay on the device
are not cached until the host reports them.

Chunked prefill: ``allocate([request], [chunk_end])``, prepare, forward, then
``cache_unfinished(request)`` for every chunk but the last (which ends with ``append_tokens``).
``prepare(requests, "decode")`` stages its batch the way ``begin_decode`` does (one decode path);
``begin_decode`` / ``DecodeStep.commit`` is the same step with the pages taken in the same call.
Every call validates before changing anything; a failed call leaves the backend unchanged.
A backend is owned by one thread: drive it from the thread that schedules the host's steps.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from kvplug.attention.batch import build_attention_batch
from kvplug.attention.decode_staging import DecodeStager
from kvplug.backend_checks import check_new_tokens, reject_append, reject_decode
from kvplug.backend_factory import BackendParts, build_parts, remote_kv_options
from kvplug.backend_stats import BackendStats
from kvplug.memory.request import ONE, BatchLease, check_lease
from kvplug.cache_guard import CacheGuard, hand_over  # issue 32 seam
from kvplug.call_gate import CallGate, backend_call  # issue 32 seam
from kvplug.decode_step import DecodeStep
from kvplug.interface import AttentionBatch, ForwardPhase, InvalidArgumentError
from kvplug.memory.allocator import PrefixLookup
from kvplug.memory.model_shape import ModelShape
from kvplug.memory.request import Request
from kvplug.memory.token_ids import as_token_ids, host_token_ids
from kvplug.prefix_cache import ownership  # issue 32 seam
from kvplug.prefix_cache.host_arrays import host_view

if TYPE_CHECKING:
    from kvplug.decode_step import DecodeGraphs

__all__ = [
    "BackendStats", "BatchLease", "DecodeStep", "KVBackend", "ModelShape", "PrefixLookup", "Request", "create_backend",
]

# ForwardPhase(value) goes through Enum's lookup machinery: a dict for the usual spellings
_PHASES: dict = {phase.value: phase for phase in ForwardPhase} | {phase: phase for phase in ForwardPhase}


class KVBackend:
    """Pool + tables + allocator + prefix cache + attention behind one request lifecycle.

    Attributes (read-only for hosts):
        shape: the model's ``ModelShape``.
        pool: the KV pool (``BaseKVPool``); ``pool.k_cache(layer)`` etc.
        tables: ``PageTable``: ``tables.table`` is the page table, ``tables.token_pool`` the token pool.
        requests: the ``RequestTable`` (rows, liveness and lengths of running requests).
        prefix_cache: the ``BasePrefixCache`` (host data).
        attention: the ``BaseAttentionBackend`` or ``None``; ``attention_name`` says which.
        allocator: the ``PagedAllocator``.
        graphs: the ``DecodeGraphs`` of ``decode_graphs`` (``None`` until then): decode steps
            that fit a captured size are staged padded into its buffers.
        cache_guard: what a fault of an untrusted prefix cache does (``kvplug.cache_guard``).

    One thread at a time (issue 32): a backend has one owner, the host's scheduler thread, and no
    lock. The lifecycle calls (``admit``, ``allocate``, ``prepare``, ``begin_decode``,
    ``append_tokens``, ``cache_unfinished``, ``finish``, ``decode_graphs``, the prefix-cache calls
    below, ``check_integrity``) refuse a call from a second thread while another thread is inside one
    (``ConcurrentUseError``, nothing changed; ``kvplug.call_gate``); calls from different threads one
    after another are fine. ``stats`` may be called from any thread (a monitoring route).
    ``prefetch`` may be called from any thread too (it queues a store read; issue 30).
    ``forward``, ``input_ids``, ``loads_ready`` and ``DecodeStep.commit`` are not checked (per-layer
    and per-step hot paths): they belong to the same thread.

    The prefix cache is owned: ``reset`` / ``evict`` called on it directly raise
    ``CacheOwnedError``; ``reset_prefix_cache`` / ``evict_prefix_cache`` do them with the pool's
    accounting kept. An untrusted cache (a plugin's) is ``prefix_cache.inner`` of a
    ``CheckedPrefixCache``, and after a hand-over ``prefix_cache`` may be an ``InheritedPrefixes``.
    """

    def __init__(self, parts: BackendParts) -> None:
        self.shape = parts.shape
        self.pool = parts.pool
        self.tables = parts.tables
        self.allocator = parts.allocator
        self.requests = parts.allocator.states
        self.prefix_cache = parts.prefix_cache
        self.attention = parts.attention
        self.attention_name = parts.attention_name
        self.device = self.tables.device
        self.graphs: DecodeGraphs | None = None
        # issue 32 seam: driven by one thread at a time (kvplug.call_gate); a prefix cache that
        # faults is replaced (kvplug.cache_guard); reset/evict on the cache itself are refused
        self._gate = CallGate()
        self.cache_guard = parts.cache_guard or CacheGuard(type(self.prefix_cache).__name__, "fail")
        self.take_cache_ownership(self.prefix_cache)
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._admitted = 0
        self._finished = 0
        # a decode batch's device fields come from a ring of slots (see DecodeStager), with the
        # page lists the attention backend plans decode batches with, when it says so
        self.stager = DecodeStager(
            self.tables.table, self.tables._tokens, page_size=self.pool.page_size,
            page_list_size=getattr(self.attention, "decode_page_list_size", None),
        )

    # ------------------------------------------------------------------ shape
    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def max_running_reqs(self) -> int:
        return self.tables.max_running_reqs

    @property
    def max_seq_len(self) -> int:
        return self.tables.max_seq_len

    @property
    def page_table(self) -> torch.Tensor:
        """shape ``[max_running_reqs + 1, row_width]``, int32, device; complete (staged writes made)."""
        self.tables.flush()
        return self.tables.table

    @property
    def token_pool(self) -> torch.Tensor:
        """shape ``[max_running_reqs + 1, row_width]``, int32, device; complete (staged writes and
        a committed decode step's ids are written first)."""
        return self.tables.token_pool

    @property
    def running_requests(self) -> list[Request]:
        return self.requests.live_requests

    # ------------------------------------------------------------------ lifecycle
    @backend_call
    def lookup(self, input_ids: torch.Tensor | Sequence[int]) -> PrefixLookup:
        """How much of a prompt is cached, without admitting it or changing anything: an opaque
        ``PrefixLookup`` (``cached_len``: tokens an admission would find cached, host tier
        included) that ``admit`` takes in place of the ids, so a scheduler deciding on the
        prompt matches it once. Host work only."""
        return self.allocator.lookup(host_token_ids(input_ids))

    @backend_call  # issue 32 seam
    def admit(self, input_ids: torch.Tensor | Sequence[int] | PrefixLookup, *, match: bool = True) -> Request:
        """Start a request: take a row, match and lock its longest cached prefix (at most
        ``len - 1`` tokens, so at least one token is computed), point the row at the match and
        write the token ids into the token pool (host now; the device at the next ``prepare``).

        Args:
            input_ids: shape ``[n]`` token ids, ``1 <= n <= max_seq_len``; a list of ints, or a
                1-D integer tensor or numpy array on the host (a GPU tensor is copied to the
                host, which waits for queued device work); or a ``PrefixLookup`` of the prompt
                (its match is used unless the cache changed since).
            match: ``False`` skips the lookup (the host just learned that nothing is cached).

        Raises ``OutOfMemoryError`` when no row is free, ``InvalidArgumentError`` for bad ids.
        """
        ids = input_ids if isinstance(input_ids, PrefixLookup) else host_token_ids(input_ids)
        request = self.allocator.open_request(self.requests.free_row(), ids, match=bool(match))
        self._admitted += 1
        self._queried_tokens += request.prompt_len
        self._hit_tokens += request.matched_len
        return request

    def prefetch(self, input_ids: torch.Tensor | Sequence[int]) -> bool:
        """A request with prompt ``input_ids`` was queued (before the scheduler admits it): start
        reading what a shared KV store under the host tier holds of it, off the serving thread,
        so that ``admit`` copies the pages instead of waiting for the network (issue 30,
        ``kvplug.prefix_cache.remote_tier``). Any thread (an HTTP handler's; it enters no gate and
        touches neither the tree nor the pool: it hashes the prompt's pages and queues the read);
        never waits. ``True``: a read was started; ``False`` without a store (or a tier whose
        ``prefetch`` does nothing), for a prompt shorter than a page, or one already prefetched.
        Raises ``InvalidArgumentError`` for bad ids."""
        cache = self.prefix_cache
        prefetch = getattr(cache, "prefetch", None) if self.allocator.tiered else None
        if prefetch is None:
            return False
        return bool(prefetch(host_token_ids(input_ids)))

    def loads_ready(self, request: Request) -> bool:
        """Whether ``request``'s matched pages are all in the KV pool: a prefix hit in the host
        tier is copied back while other work runs, and a forward over the request before the copy
        completes would wait for it (``prepare`` / ``begin_decode`` order it, so the result is
        correct either way). A scheduler keeps the request out of its batches meanwhile; never
        blocks."""
        return self.allocator.loads_ready(request)

    @backend_call  # issue 32 seam
    def allocate(self, requests: Sequence[Request], new_device_lens: Sequence[int] | None = None) -> None:
        """Set each request's ``device_len`` (default: ``num_tokens``, every known token) and give
        it the pages that takes, evicting cached prefixes when needed; all or nothing
        (``OutOfMemoryError`` says how many pages were needed and available)."""
        self.allocator.allocate(_request_list(requests), new_device_lens)

    @backend_call  # issue 32 seam
    def prepare(self, requests: Sequence[Request], phase: ForwardPhase | str) -> AttentionBatch:
        """Describe the next forward over ``requests`` (tokens ``cached_len .. device_len - 1``
        of each) and let the attention backend plan it. ``phase``: ``"prefill"`` or ``"decode"``
        (one new token each: staged as ``begin_decode`` stages). Makes the step's staged table
        writes first."""
        if not isinstance(phase, (str, ForwardPhase)) or phase not in _PHASES:
            raise InvalidArgumentError(f"phase must be 'prefill', 'decode' or a ForwardPhase, got {phase!r}")
        phase = _PHASES[phase]
        requests = _request_list(requests)
        states = self.requests
        rows, row_starts = states.batch_rows(requests)
        cached = states.cached_len[rows]
        check_new_tokens(rows, cached, states.device_len[rows], phase)
        if phase is ForwardPhase.DECODE:
            return self._stage_decode(requests, rows, row_starts + cached, cached, None, None)[0]
        self._before_forward(rows)
        batch = build_attention_batch(self.tables.table, rows, cached, states.device_len[rows], phase, validate=False)
        batch.lease = BatchLease(states, states.generation, tuple(requests))
        if self.attention is not None:
            self.attention.prepare_metadata(batch)
        return batch

    @backend_call  # issue 32 seam
    def begin_decode(self, requests: Sequence[Request]) -> DecodeStep:
        """Stage one decode step over ``requests``: each has exactly one known token past its
        cached ones (after a prefill's ``append_tokens`` or the previous step's ``commit``); it
        gets the page that token needs, its batch entry and input id, and attention is planned.
        When ``decode_graphs`` captured a size that fits, the step is staged padded into that
        graph's buffers (``DecodeGraphs.run`` replays it).

        Returns the ``DecodeStep``; run the forward over it, then ``step.commit(next_ids)``.
        Raises ``InvalidArgumentError`` or ``OutOfMemoryError`` with nothing changed.
        """
        requests = _request_list(requests)
        if not requests:
            raise InvalidArgumentError("a decode step needs at least one request, got none")
        states = self.requests
        rows, row_starts = states.batch_rows(requests)
        cached = states.cached_len[rows]
        device_lens = cached + ONE
        if np.count_nonzero(states.num_tokens[rows] - device_lens):
            reject_decode(rows, cached, states.num_tokens[rows], self.max_seq_len)
        cells = row_starts + cached  # each new token's cell in the page table and token pool
        # the whole decode allocation rule: a request whose new token starts a page takes one
        pages = self.allocator.take_decode_pages(rows, cached, cells)
        states.schedule(rows, device_lens)
        batch, graph_size, stamp = self._stage_decode(requests, rows, cells, cached, pages, self.graphs)
        return DecodeStep(self.tables, states, batch, rows, cached, cells, graph_size, stamp)

    def _stage_decode(self, requests: Sequence[Request], rows: np.ndarray, cells: np.ndarray,
                      cached: np.ndarray, pages: Any, graphs: "DecodeGraphs | None") -> tuple:
        """The one decode staging: the step's staged writes and pending loads first, then one
        staging launch (padded into a graph's buffers when ``graphs`` has a size that fits),
        then attention's plan. Returns ``(batch, graph_size, stamp)``."""
        # the flush takes the pending ids: handed to this launch when it covers their cells
        tokens = self._before_forward(rows, cells)
        graph_size = None if graphs is None else graphs.size_for(rows.size)
        stamp = 0 if graph_size is None else graphs.claim(graph_size)
        batch = self.stager.stage(rows, cached, pages=pages, tokens=tokens, pad_to=graph_size)
        states = self.requests
        batch.lease = BatchLease(states, states.generation, requests if isinstance(requests, tuple) else tuple(requests))
        if self.attention is not None:
            if graph_size is not None and graphs.uses_cuda_graphs:
                self.attention.prepare_for_replay(batch)
            else:
                self.attention.prepare_metadata(batch)
        return batch, graph_size, stamp

    def _before_forward(self, rows: np.ndarray, decode_cells: np.ndarray | None = None) -> torch.Tensor | None:
        """What must reach the device before a forward over ``rows``: the rows' pending host-tier
        loads and the step's staged table writes (the one flush point, which takes a committed
        step's pending ids: returned when ``decode_cells`` are exactly their cells)."""
        if self.allocator.has_pending_loads:  # pages still copying from the host tier
            self.allocator.order_loads(rows)
        return self.tables.flush(decode_cells)

    def input_ids(self, batch: AttentionBatch) -> torch.Tensor:
        """Token ids of the batch's new tokens, on the device: shape ``[num_tokens]``, int32.

        A decode batch carries them (its staging launch read them): the result is then a view
        of the batch's slot, valid as long as the batch's own tensors (``ring_size`` decode
        steps); clone it to keep it longer. Otherwise they are gathered from the token pool into
        a new tensor."""
        input_ids = getattr(batch, "input_ids", None)
        if input_ids is not None:
            return input_ids
        if not isinstance(batch, AttentionBatch):
            raise InvalidArgumentError(f"expected an AttentionBatch from prepare(), got {type(batch).__name__}")
        if batch.is_decode:
            # one token per request: flat index row * width + position, one fused op and one gather
            flat_index = torch.add(batch.positions, batch.table_rows, alpha=self.tables.row_width)
            return self.tables.token_pool.view(-1).index_select(0, flat_index)
        extend_lens = batch.extend_start[1:] - batch.extend_start[:-1]
        token_rows = torch.repeat_interleave(batch.table_rows, extend_lens, output_size=batch.num_tokens)
        return self.tables.gather_tokens_at(token_rows, batch.positions)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: AttentionBatch
    ) -> torch.Tensor:
        """Store the new K/V at ``batch.out_loc`` and attend (``BaseAttentionBackend.forward``).

        A batch this backend prepared is refused once one of its requests was finished (one int
        comparison per call while no request started or ended)."""
        if self.attention is None:
            raise InvalidArgumentError("this backend was created with attention=None; run attention in the host")
        lease, states = batch.lease, self.requests
        if lease is not None and (lease.generation != states.generation or lease.states is not states):
            check_lease(lease, states)
        return self.attention.forward(q, k, v, layer_id, batch)

    @backend_call  # issue 32 seam
    def append_tokens(self, requests: Sequence[Request], token_ids: torch.Tensor | Sequence[int]) -> None:
        """After a forward that covered every known token: mark it done (``cached_len =
        device_len``) and append one sampled token per request to the token pool (one write).

        Args:
            token_ids: shape ``[bs]``, int32: a device tensor (stays on the device; its values
                are not known to the host, so not cached until reported) or host values (a list
                or CPU tensor: known, uploaded without a wait).
        """
        states = self.requests
        rows, row_starts = states.batch_rows(_request_list(requests))
        on_host = not (isinstance(token_ids, torch.Tensor) and token_ids.device.type != "cpu")
        if (not on_host and type(token_ids) is torch.Tensor and token_ids.dtype is torch.int32
                and token_ids.device == self.device):
            ids = token_ids  # the usual case, sampled ids on the GPU (dim checked below; values not: a sync)
        else:
            ids = as_token_ids(token_ids, self.device, allow_empty=True)
        if ids.dim() != 1 or ids.shape[0] != rows.size:
            raise InvalidArgumentError(
                f"need one token id per request: {rows.size} requests, token ids of shape {tuple(ids.shape)}"
            )
        cached, device_lens, num_tokens = states.cached_len[rows], states.device_len[rows], states.num_tokens[rows]
        not_ready = (device_lens != num_tokens) | (device_lens <= cached)
        if np.count_nonzero(not_ready) or (rows.size and num_tokens.max() >= self.tables.max_seq_len):
            reject_append(rows, cached, device_lens, num_tokens, not_ready, self.max_seq_len)
        # rows are live and num_tokens < max_seq_len <= row width: the flat index is in range
        cells = row_starts + num_tokens
        self.tables.write_flat(self.tables._tokens, cells, ids)
        if on_host:
            self.tables.host_tokens.reshape(-1)[cells] = host_token_ids(token_ids, allow_empty=True).numpy()
        states.appended(rows, known=on_host)

    @backend_call
    def record_tokens(self, request: Request, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Tell kvplug the token ids ``request`` holds as the host knows them (its prompt first,
        then what it sampled): ids sampled on the device become keys the prefix cache can keep.
        Ids past ``num_tokens`` are ignored; the part kvplug already knows must agree.

        Raises ``InvalidArgumentError`` (nothing changed) when they do not start with the ids
        kvplug knows."""
        self.allocator.check_live(request)
        ids = host_token_ids(token_ids, allow_empty=True).numpy()
        row, known = request.row, request.known_len
        if ids.shape[0] < known or not np.array_equal(ids[:known], self.tables.host_token_ids(row, 0, known)):
            raise InvalidArgumentError(
                f"request in row {row}: the reported {ids.shape[0]} token ids do not start with the {known} ids "
                "kvplug knows (the prompt, then host-known sampled ids)"
            )
        end = min(ids.shape[0], request.num_tokens)
        if end > known:
            self.tables.note_tokens(row, known, ids[known:end])
            self.requests.know(row, end)

    @backend_call  # issue 32 seam
    def cache_unfinished(self, request: Request) -> None:
        """After a non-final prefill chunk's forward: mark it done and move the computed
        page-aligned prefix into the prefix cache (the request keeps using it, locked)."""
        self.allocator.check_live(request)
        self.allocator.mark_computed([request])
        self.allocator.cache_request(request, finished=False)

    @backend_call  # issue 32 seam
    def finish(self, request: Request, *, computed: bool = False,
               tokens: Sequence[int] | np.ndarray | torch.Tensor | None = None) -> None:
        """End a request: its page-aligned computed prefix goes into the prefix cache, every
        other page back to the free list, its row is freed.

        ``computed=True`` says the last allocated forward (tokens ``cached_len .. device_len``)
        ran though ``append_tokens`` was not called after it, so those tokens may be cached too.
        Leave it ``False`` when aborting before a forward ran: caching unwritten K/V would poison
        the cache. ``tokens``: the request's ids as the host knows them (``record_tokens``), so
        sampled ids that stayed on the device are cached too.
        """
        self.allocator.check_live(request)
        if tokens is not None:
            self.record_tokens(request, tokens)
        if computed:
            self.allocator.mark_computed([request])
        self.allocator.cache_request(request, finished=True)
        self._finished += 1

    @contextlib.contextmanager
    def lazy_free(self) -> Iterator[None]:
        """Frees made inside (``finish``, duplicate pages) are applied at the block's end (the
        region owns them: ``kvplug.memory.deferred_frees``)."""
        with self.allocator.lazy_free():
            yield

    # ------------------------------------------------------------------ CUDA graphs
    @backend_call  # issue 32 seam
    def decode_graphs(
        self,
        forward_fn: Callable[[DecodeStep], torch.Tensor],
        *,
        batch_sizes: Sequence[int] | None = None,
        max_batch_size: int | None = None,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> "DecodeGraphs":
        """Capture ``forward_fn`` (the host's whole decode forward over a ``DecodeStep``:
        reading ``step.input_ids``, ``step.positions``, ``step.batch``; returning a tensor whose
        first dim is the batch) as CUDA graphs at ``batch_sizes`` (default: 1, 2, 4, 8, then
        steps of 8 up to ``max_batch_size``, default ``max_running_reqs``). From then on
        ``begin_decode`` stages every step that fits a captured size padded into its graph's
        buffers (the dummy request fills the unused slots) and ``graphs.run(step)`` replays it;
        larger steps stay eager. Off CUDA the same buffers and calls run ``forward_fn`` eagerly.
        Calling again replaces the graphs; ``graphs.release()`` goes back to eager steps."""
        from kvplug.decode_step import DecodeGraphs

        if self.attention is None:
            raise InvalidArgumentError("decode_graphs needs an attention backend (this one has attention=None)")
        if self.graphs is not None:
            self.graphs.release()
        graphs = DecodeGraphs(self, forward_fn, batch_sizes=batch_sizes,
                              max_batch_size=self.max_running_reqs if max_batch_size is None else max_batch_size,
                              progress=progress)
        graphs.capture()
        self.graphs = graphs
        return graphs

    # ------------------------------------------------------------------ observation
    def stats(self) -> BackendStats:
        """A snapshot; callable from any thread (a monitoring route): it enters no gate, and a checked
        cache's sizes come from its own bookkeeping (no plugin call, no recovery)."""
        allocator = self.allocator
        free = allocator.num_free_pages
        cached, evictable = self._cache_pages()  # issue 32 seam: no call into an untrusted plugin
        return BackendStats(
            queried_tokens=self._queried_tokens,
            cache_hit_tokens=self._hit_tokens,
            evicted_tokens=allocator.evicted_tokens,
            admitted_requests=self._admitted,
            finished_requests=self._finished,
            running_requests=self.requests.num_live,
            num_pages=self.num_pages,
            free_pages=free,
            cached_pages=cached,
            evictable_pages=evictable,
            used_pages=self.num_pages - free,
            host_hit_tokens=allocator.host_hit_tokens,
            tier=self._tier_stats() if allocator.tiered else None,
            prefix_cache=self.cache_guard.as_dict(),  # issue 32 seam
        )

    # ------------------------------------------------------------------ the prefix cache (issue 32)
    def _tier_stats(self) -> dict:
        """The tier's counters for ``stats``: a checked cache's latest snapshot (no plugin call)."""
        cache = self.prefix_cache
        tracked = getattr(cache, "tracked_tier_stats", None)
        return (tracked if tracked is not None else cache.tier_stats()).as_dict()

    def _cache_pages(self) -> tuple[int, int]:
        """(cached, evictable) pages of the prefix cache, for ``stats``: never a call into an untrusted
        plugin (``stats`` runs on any thread, and must neither race the owner's calls through the
        gate nor start a recovery), so a checked cache answers from its own bookkeeping."""
        cache = self.prefix_cache
        tracked = getattr(cache, "tracked_size_info", None)
        size = tracked if tracked is not None else cache.size_info
        return size.total_size // self.page_size, size.evictable_size // self.page_size

    def take_cache_ownership(self, cache) -> None:
        """Refuse ``reset`` / ``evict`` called on ``cache`` (and a checked cache's plugin) from outside
        this backend's calls (``kvplug.prefix_cache.ownership``)."""
        while cache is not None:  # a checked cache's plugin, a hand-over layer's cache: all gated
            if not ownership.is_owned(cache):
                ownership.take_ownership(cache, self._gate.inside)
            cache = getattr(cache, "inner", None)

    @backend_call
    def available_pages(self) -> int:
        """Pages an allocation could obtain now: free plus evictable from the prefix cache."""
        return self.allocator.num_free_pages + self.allocator.num_evictable_pages

    @backend_call
    def cached_prefix_len(self, input_ids: torch.Tensor) -> int:
        """Tokens of ``input_ids`` (shape ``[n]``, int32, host) the prefix cache holds now, in any
        tier (a scheduler's look-up before admitting; nothing is locked)."""
        cache = self.prefix_cache
        if self.allocator.tiered:
            match = cache.match_tiered(input_ids)
            return int(match.handle.cached_len) + int(match.host_len)
        if self.allocator.host_arrays and (ids := host_view(input_ids)) is not None:
            return cache.match_host(ids).cached_len
        return int(cache.match_prefix(input_ids).handle.cached_len)

    @backend_call
    def evict_prefix_cache(self, tokens: int) -> int:
        """Evict at least ``tokens`` tokens of unlocked cached prefixes; their pages go to the free
        list. Returns the tokens evicted (``InvalidArgumentError`` past the evictable size)."""
        if self.allocator.host_arrays:
            locations = self.prefix_cache.evict_host(tokens)
        else:
            locations = self.prefix_cache.evict(tokens).numpy()
        self.allocator.evicted_tokens += int(locations.shape[0])
        self.allocator.free_list.release(locations[locations % self.page_size == 0], immediately=True)
        return int(locations.shape[0])

    @backend_call
    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache: its pages go to the free list, except running requests' locked
        prefixes, kept for them until they finish (``kvplug.cache_guard.hand_over``). Returns the
        pages freed. Not with a host tier."""
        return hand_over(self, self.prefix_cache, reset_old=True).freed_pages

    @backend_call  # issue 32 seam
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if any memory invariant is broken (reads every live row)."""
        self.allocator.check_integrity()
        self.prefix_cache.check_integrity()


def _request_list(requests: Any) -> Sequence[Request]:
    """``requests`` if it is a list or tuple (of anything: ``batch_rows`` checks the elements)."""
    if isinstance(requests, (list, tuple)):
        return requests
    raise InvalidArgumentError(f"expected a list of kvplug Requests, got {type(requests).__name__}")


def create_backend(
    model_config: ModelShape | Mapping[str, Any] | Any,
    *,
    page_size: int = 1,
    num_pages: int | None = None,
    memory_budget: int | str | None = None,
    max_running_reqs: int = 256,
    max_seq_len: int = 4096,
    prefix_cache: Any = "radix",
    attention: str | None = "auto",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    manager: Any = None,
    validate: bool | None = None,
    attention_options: Mapping[str, Any] | None = None,
    prefix_cache_options: Mapping[str, Any] | None = None,
    on_cache_failure: str = "fallback",
    fallback_prefix_cache: str = "naive",
    remote_kv: Any = None,
    remote_kv_model: str | None = None,
) -> "KVBackend":
    """Build a ``KVBackend``.

    Args:
        model_config: a ``ModelShape`` or a HF config (mapping or ``PretrainedConfig``).
        page_size: tokens per page.
        num_pages: usable pages; exactly one of ``num_pages`` / ``memory_budget`` is required.
        memory_budget: bytes (or ``"40GiB"``) for the pool on this rank, dummy page included.
        max_running_reqs: page-table rows for live requests.
        max_seq_len: longest request in tokens (prompt + generated).
        prefix_cache: a registered name (``"radix"``, ``"naive"``, a plugin's) or a
            ``BasePrefixCache`` instance built for this device and page size.
        attention: a registered name, ``"P,D"``, ``"auto"`` (flashinfer if importable on CUDA,
            else triton on CUDA, else torch), or ``None`` for a memory-only backend whose host
            runs attention itself over ``pool`` and ``page_table``.
        device: where the pool and the device tables live (the prefix cache keeps host data).
        dtype: KV dtype; defaults to the model's.
        tp_size, tp_rank: tensor parallelism; the pool keeps this rank's KV heads.
        manager: a ``kvplug.PluginManager``; the default one if ``None``.
        validate: let the pool check every ``out_loc`` range (a device sync per store). ``None``:
            on for CPU, off for CUDA.
        attention_options: passed to the attention backend as ``AttentionConfig.options``.
        prefix_cache_options: options of the prefix cache built by name (``PrefixCacheConfig.options``),
            e.g. ``{"host_memory": "32GiB"}`` for ``radix`` with a host-memory tier, whose page pool
            is then allocated next to the KV pool.
        on_cache_failure: what a fault of an untrusted prefix cache does (``kvplug.cache_guard``):
            ``"fallback"`` hands the pool to ``fallback_prefix_cache`` and goes on, ``"fail"``
            raises ``PrefixCacheFault`` from then on.
        fallback_prefix_cache: the registered name that takes over after a fault (its own name:
            a fresh instance of the same factory).
        remote_kv: a shared KV store under the host tier (issue 30): a URL (``"redis://:PASSWORD@HOST:PORT/DB"``,
            a registered ``kv_store`` scheme) or a ``kvplug.BaseKVStore``. Needs ``prefix_cache="radix"``
            with ``prefix_cache_options={"host_memory": ...}`` and a CPU pool.
        remote_kv_model: the model's identity in the store's keys (required with ``remote_kv``):
            servers of one checkpoint share pages only when they give the same id.
    """
    prefix_cache_options = remote_kv_options(prefix_cache, prefix_cache_options, remote_kv, remote_kv_model)
    parts = build_parts(
        model_config,
        page_size=page_size,
        num_pages=num_pages,
        memory_budget=memory_budget,
        max_running_reqs=max_running_reqs,
        max_seq_len=max_seq_len,
        prefix_cache=prefix_cache,
        attention=attention,
        device=device,
        dtype=dtype,
        tp_size=tp_size,
        tp_rank=tp_rank,
        manager=manager,
        validate=validate,
        attention_options=attention_options,
        prefix_cache_options=prefix_cache_options,
        on_cache_failure=on_cache_failure,
        fallback_prefix_cache=fallback_prefix_cache,
    )
    return KVBackend(parts)
