"""The facade a host engine talks to: ``kvplug.create_backend(...)`` -> ``KVBackend`` (docs/design.md, section 4).

One object owns the pool, page table + token pool, request rows, paged allocator, prefix cache
and attention backend, and exposes the request lifecycle::

    request = backend.admit(prompt_ids)            # row, prefix match + lock, token ids
    backend.allocate([request])                    # pages for every known token (atomic)
    batch = backend.prepare([request], "prefill")  # AttentionBatch + backend metadata
    input_ids = backend.input_ids(batch)           # on the device, from the token pool
    ... model forward; per layer: out = backend.forward(q, k, v, layer_id, batch)
    backend.append_tokens([request], next_ids)     # forward done; sampled id into the token pool
    step = backend.begin_decode(requests)          # decode: pages, batch, input ids in one call
    ... forward over step.batch (or graphs.run(step)); step.commit(next_ids); repeat
    backend.finish(request)                        # prefix into the cache, tail freed, row freed

Chunked prefill: ``allocate([request], [chunk_end])``, prepare, forward, then
``cache_unfinished(request)`` for every chunk but the last (which ends with ``append_tokens``).
``allocate -> prepare(..., "decode") -> append_tokens`` still runs a decode step, call by call;
``begin_decode`` / ``DecodeStep.commit`` is the same step at a third of the host time (one
staging launch writes its pages, reads its input ids and takes the previous commit's ids).
Every call validates before changing anything; a failed call leaves the backend unchanged.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import torch

from kvplug.attention.batch import build_attention_batch
from kvplug.attention.decode_batch import build_decode_batch
from kvplug.attention.decode_staging import DecodeStager, StagedDecodeBatch
from kvplug.backend_checks import check_new_tokens, reject_append, reject_decode
from kvplug.backend_factory import BackendParts, create_backend
from kvplug.backend_stats import BackendStats
from kvplug.batch_lease import BatchLease, check_lease
from kvplug.cache_guard import CacheGuard, hand_over  # issue 32 seam
from kvplug.call_gate import CallGate, backend_call  # issue 32 seam
from kvplug.decode_step import DecodeStep
from kvplug.interface import AttentionBatch, ForwardPhase, InvalidArgumentError
from kvplug.memory.model_shape import ModelShape
from kvplug.memory.request import Request
from kvplug.memory.token_ids import as_token_ids
from kvplug.prefix_cache import ownership  # issue 32 seam

if TYPE_CHECKING:
    from kvplug.decode_graphs import DecodeGraphs

__all__ = ["BackendStats", "BatchLease", "DecodeStep", "KVBackend", "ModelShape", "Request", "create_backend"]

# ForwardPhase(value) goes through Enum's lookup machinery, about 1 us: a dict for the usual spellings
_PHASES: dict = {phase.value: phase for phase in ForwardPhase} | {phase: phase for phase in ForwardPhase}


class KVBackend:
    """Pool + tables + allocator + prefix cache + attention behind one request lifecycle.

    Attributes (read-only for hosts):
        shape: the model's ``ModelShape``.
        pool: the KV pool (``BaseKVPool``); ``pool.k_cache(layer)`` etc.
        tables: ``PageTable``: ``tables.table`` is the page table, ``tables.token_pool`` the token pool.
        prefix_cache: the ``BasePrefixCache``.
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
        self.rows = parts.rows
        self.allocator = parts.allocator
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
        # GPU tables: a decode batch's device fields come from a ring of slots (see DecodeStager),
        # with the page lists the attention backend plans decode batches with, when it says so
        self.stager = DecodeStager(
            self.tables.table, self.tables.token_pool, page_size=self.pool.page_size,
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
        """shape ``[max_running_reqs + 1, row_width]``, int32, device."""
        return self.tables.table

    @property
    def token_pool(self) -> torch.Tensor:
        """shape ``[max_running_reqs + 1, row_width]``, int32, device; complete (a committed
        decode step's ids are written first)."""
        return self.tables.token_pool

    @property
    def running_requests(self) -> list[Request]:
        return self.allocator.live_requests

    # ------------------------------------------------------------------ lifecycle
    @backend_call  # issue 32 seam
    def admit(self, input_ids: torch.Tensor | Sequence[int]) -> Request:
        """Start a request: take a row, match and lock its longest cached prefix (at most
        ``len - 1`` tokens, so at least one token is computed), point the row at the match and
        write the token ids into the token pool.

        Args:
            input_ids: shape ``[n]`` token ids, ``1 <= n <= max_seq_len``; a 1-D integer tensor
                (any device; converted to int32 on the backend's device) or a list of ints.

        Raises ``OutOfMemoryError`` when no row is free, ``InvalidArgumentError`` for bad ids.
        """
        ids = as_token_ids(input_ids, self.device, check_values=True)
        row = self.rows.allocate()
        try:
            request = self.allocator.open_request(row, ids)
        except BaseException:
            self.rows.free(row)
            raise
        self._admitted += 1
        self._queried_tokens += request.prompt_len
        self._hit_tokens += request.matched_len
        return request

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
        of each) and let the attention backend plan it. ``phase``: ``"prefill"`` or ``"decode"``."""
        if not isinstance(phase, (str, ForwardPhase)) or phase not in _PHASES:
            raise InvalidArgumentError(f"phase must be 'prefill', 'decode' or a ForwardPhase, got {phase!r}")
        phase = _PHASES[phase]
        states = self.allocator.states
        rows, row_starts = states.batch_rows(_request_list(requests))
        if self.allocator.has_pending_loads:  # pages still copying from the host tier
            self.allocator.order_loads(rows)
        cached = states.cached_len[rows]
        device_lens = states.device_len[rows]
        check_new_tokens(rows, cached, device_lens, phase)
        if phase is ForwardPhase.DECODE and not self.tables.uses_host_views:  # tables used through torch
            tokens = self.tables.take_pending_tokens(row_starts + cached)
            batch = self.stager.stage(rows, cached, tokens=tokens)
        elif phase is ForwardPhase.DECODE:  # tables in host memory
            self.tables.settle_tokens()
            batch = build_decode_batch(
                self.tables.table, rows, cached, flat_table=self.tables.flat_table, row_starts=row_starts
            )
        else:
            batch = build_attention_batch(self.tables.table, rows, cached, device_lens, phase, validate=False)
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
        states = self.allocator.states
        rows, row_starts = states.batch_rows(requests)
        cached = states.cached_len[rows]
        if np.count_nonzero(states.num_tokens[rows] - cached - 1):
            reject_decode(rows, cached, states.num_tokens[rows], self.max_seq_len)
        if self.allocator.has_pending_loads:  # pages still copying from the host tier
            self.allocator.order_loads(rows)
        graphs = self.graphs
        graph_size = None if graphs is None else graphs.size_for(rows.size)
        pages = self.allocator.take_decode_pages(rows, cached)
        cells = row_starts + cached
        stamp = 0
        if graph_size is not None or not self.tables.uses_host_views:
            tokens = self.tables.take_pending_tokens(cells)
            if graph_size is not None:
                stamp = graphs.claim(graph_size)
            batch = self.stager.stage(rows, cached, pages=pages, tokens=tokens, pad_to=graph_size)
            input_ids, append_index = batch.input_ids, batch.append_index
        else:
            if pages is not None:
                self.allocator.write_decode_pages(rows, cached, pages)
            self.tables.settle_tokens()
            batch = build_decode_batch(self.tables.table, rows, cached, flat_table=self.tables.flat_table,
                                       row_starts=row_starts)
            input_ids = torch.from_numpy(self.tables.token_pool.view(-1).numpy()[cells].astype(np.int32))
            append_index = None
        states.device_len[rows] = cached + 1
        batch.lease = BatchLease(states, states.generation, requests if isinstance(requests, tuple) else tuple(requests))
        if self.attention is not None:
            if graph_size is not None and graphs.uses_cuda_graphs:
                self.attention.prepare_for_replay(batch)
            else:
                self.attention.prepare_metadata(batch)
        return DecodeStep(self, batch.lease.requests, batch, input_ids, rows, cached, cells, append_index, graph_size,
                          stamp)

    def input_ids(self, batch: AttentionBatch) -> torch.Tensor:
        """Token ids of the batch's new tokens, on the device: shape ``[num_tokens]``, int32.

        A decode batch staged on GPU tables carries them (its staging launch read them): the
        result is then a view of the batch's slot, valid as long as the batch's own tensors
        (``ring_size`` decode steps); clone it to keep it longer. Otherwise they are gathered
        from the token pool into a new tensor."""
        if isinstance(batch, StagedDecodeBatch) and batch.input_ids is not None:
            return batch.input_ids
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
        lease, states = batch.lease, self.allocator.states
        if lease is not None and (lease.generation != states.generation or lease.states is not states):
            check_lease(lease, states)
        return self.attention.forward(q, k, v, layer_id, batch)

    @backend_call  # issue 32 seam
    def append_tokens(self, requests: Sequence[Request], token_ids: torch.Tensor | Sequence[int]) -> None:
        """After a forward that covered every known token: mark it done (``cached_len =
        device_len``) and append one sampled token per request to the token pool (one write).

        Args:
            token_ids: shape ``[bs]``, int32 (device tensor, stays on the device) or a list of ints.
        """
        states = self.allocator.states
        rows, row_starts = states.batch_rows(_request_list(requests))
        if (type(token_ids) is torch.Tensor and token_ids.dtype is torch.int32 and token_ids.device == self.device
                and self.device.type != "cpu"):
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
        self.tables.write_flat(self.tables.token_pool, row_starts + num_tokens, ids)
        states.cached_len[rows] = device_lens
        states.num_tokens[rows] = num_tokens + 1

    @backend_call  # issue 32 seam
    def cache_unfinished(self, request: Request) -> None:
        """After a non-final prefill chunk's forward: mark it done and move the computed
        page-aligned prefix into the prefix cache (the request keeps using it, locked)."""
        self.allocator.check_live(request)
        self.allocator.mark_computed([request])
        self.allocator.cache_request(request, finished=False)

    @backend_call  # issue 32 seam
    def finish(self, request: Request, *, computed: bool = False) -> None:
        """End a request: its page-aligned computed prefix goes into the prefix cache, every
        other page back to the free list, its row is freed.

        ``computed=True`` says the last allocated forward (tokens ``cached_len .. device_len``)
        ran though ``append_tokens`` was not called after it, so those tokens may be cached too.
        Leave it ``False`` when aborting before a forward ran: caching unwritten K/V would poison
        the cache.
        """
        self.allocator.check_live(request)
        if computed:
            self.allocator.mark_computed([request])
        self.allocator.cache_request(request, finished=True)
        self.rows.free(request.row)
        self._finished += 1

    @contextlib.contextmanager
    def lazy_free(self) -> Iterator[None]:
        """Frees made inside (``finish``, duplicate pages) are applied at the block's end."""
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
        from kvplug.decode_graphs import DecodeGraphs

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
            running_requests=self.rows.num_live,
            num_pages=self.num_pages,
            free_pages=free,
            cached_pages=cached,
            evictable_pages=evictable,
            used_pages=self.num_pages - free,
            host_hit_tokens=allocator.host_hit_tokens,
            tier=self.prefix_cache.tier_stats().as_dict() if allocator.tiered else None,
            prefix_cache=self.cache_guard.as_dict(),  # issue 32 seam
        )

    # ------------------------------------------------------------------ the prefix cache (issue 32)
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
        return int(cache.match_prefix(input_ids).handle.cached_len)

    @backend_call
    def evict_prefix_cache(self, tokens: int) -> int:
        """Evict at least ``tokens`` tokens of unlocked cached prefixes; their pages go to the free
        list. Returns the tokens evicted (``InvalidArgumentError`` past the evictable size)."""
        evicted = self.prefix_cache.evict(tokens)
        self.allocator.evicted_tokens += int(evicted.shape[0])
        page_starts = evicted[evicted % self.page_size == 0].to(self.device)
        self.allocator.free_list.release(page_starts, immediately=True)
        return int(evicted.shape[0])

    @backend_call
    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache: its pages go to the free list, except running requests' locked
        prefixes, kept for them until they finish (``kvplug.cache_guard.hand_over``). Returns the
        pages freed. Not with a host tier."""
        return hand_over(self, self.prefix_cache, reset_old=True).freed_pages

    @backend_call  # issue 32 seam
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if any memory invariant is broken (reads every live row)."""
        self.rows.check_integrity()
        assert self.rows.live_rows == {r.row for r in self.allocator.live_requests}, "rows and requests disagree"
        self.allocator.check_integrity()
        self.prefix_cache.check_integrity()


def _request_list(requests: Any) -> Sequence[Request]:
    """``requests`` if it is a list or tuple (of anything: ``batch_rows`` checks the elements)."""
    if isinstance(requests, (list, tuple)):
        return requests
    raise InvalidArgumentError(f"expected a list of kvplug Requests, got {type(requests).__name__}")
