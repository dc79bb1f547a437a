"""The facade a host engine talks to: ``kvplug.create_backend(...)`` -> ``KVBackend`` (SPEC §4).

One object owns the pool, page table + token pool, request rows, paged allocator, prefix cache
and attention backend, and exposes the request lifecycle::

    request = backend.admit(prompt_ids)            # row, prefix match + lock, token ids
    backend.allocate([request])                    # pages for every known token (atomic)
    batch = backend.prepare([request], "prefill")  # AttentionBatch + backend metadata
    input_ids = backend.input_ids(batch)           # gathered on the device from the token pool
    ... model forward; per layer: out = backend.forward(q, k, v, layer_id, batch)
    backend.append_tokens([request], next_ids)     # forward done; sampled id into the token pool
    ... decode: allocate -> prepare(..., "decode") -> forward -> append_tokens, repeatedly
    backend.finish(request)                        # prefix into the cache, tail freed, row freed

Chunked prefill: ``allocate([request], [chunk_end])``, prepare, forward, then
``cache_unfinished(request)`` for every chunk but the last (which ends with ``append_tokens``).
Every call validates before changing anything; a failed call leaves the backend unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np
import torch

from kvplug.attention.batch import build_attention_batch
from kvplug.attention.decode_batch import build_decode_batch
from kvplug.backend_checks import check_new_tokens, reject_append
from kvplug.backend_factory import create_backend
from kvplug.backend_stats import BackendStats
from kvplug.backend_view import KVBackendView, StagedStep
from kvplug.interface import AttentionBatch, ForwardPhase, InvalidArgumentError
from kvplug.memory.deferred_appends import DeferredAppend
from kvplug.memory.model_shape import ModelShape
from kvplug.memory.request import Request
from kvplug.memory.token_ids import as_token_ids

__all__ = ["BackendStats", "KVBackend", "ModelShape", "Request", "create_backend"]

# ForwardPhase(value) goes through Enum's lookup machinery, about 1 us: a dict for the usual spellings
_PHASES: dict = {phase.value: phase for phase in ForwardPhase} | {phase: phase for phase in ForwardPhase}


class KVBackend(KVBackendView):
    """Pool + tables + allocator + prefix cache + attention behind one request lifecycle (the
    attributes, sizes, ``stats`` and ``check_integrity`` come from ``KVBackendView``).
    """

    # ------------------------------------------------------------------ lifecycle
    def admit(self, input_ids: torch.Tensor | Sequence[int]) -> Request:
        """Start a request: take a row, match and lock its longest cached prefix (at most
        ``len - 1`` tokens, so at least one token is computed), point the row at the match and
        write the token ids into the token pool.

        Args:
            input_ids: shape ``[n]`` token ids, ``1 <= n <= max_seq_len``; a 1-D integer tensor
                (any device; converted to int32 on the backend's device) or a list of ints.

        Raises ``OutOfMemoryError`` when no row is free, ``InvalidArgumentError`` for bad ids.
        """
        ids = as_token_ids(input_ids, self.device)
        self._calls += 1
        self._flush_appends()
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

    def allocate(self, requests: Sequence[Request], new_device_lens: Sequence[int] | None = None) -> None:
        """Set each request's ``device_len`` (default: ``num_tokens``, every known token) and give
        it the pages that takes, evicting cached prefixes when needed; all or nothing
        (``OutOfMemoryError`` says how many pages were needed and available)."""
        self._calls += 1
        appended = self._appended
        decoding = appended[0] if appended is not None and appended[1] == self._calls - 1 else None
        rows = self.allocator.allocate(requests, new_device_lens, decoding_rows=decoding)
        # every known token allocated: device_len == num_tokens (== cached_len + 1 when decoding)
        self._filled = (rows, self._calls, rows is decoding) if new_device_lens is None else None

    def prepare(self, requests: Sequence[Request], phase: ForwardPhase | str) -> AttentionBatch:
        """Describe the next forward over ``requests`` (tokens ``cached_len .. device_len - 1``
        of each) and let the attention backend plan it. ``phase``: ``"prefill"`` or ``"decode"``."""
        if not isinstance(phase, (str, ForwardPhase)) or phase not in _PHASES:
            raise InvalidArgumentError(f"phase must be 'prefill', 'decode' or a ForwardPhase, got {phase!r}")
        phase = _PHASES[phase]
        self._calls += 1
        states = self.allocator.states
        rows, row_starts = states.batch_rows(requests)
        cached = states.cached_len[rows]
        filled = self._filled
        chained = filled is not None and filled[0] is rows and filled[1] == self._calls - 1
        if chained and filled[2] and phase is ForwardPhase.DECODE:
            device_lens = cached + 1  # allocate just gave each of them its one new token
        else:
            device_lens = states.device_len[rows]
            check_new_tokens(rows, cached, device_lens, phase)
        flat_table = self.tables.flat_table
        if phase is ForwardPhase.DECODE and not isinstance(flat_table, np.ndarray):  # tables used through torch
            appended = self._deferred_append
            if appended is not None and appended.rows is not rows:
                self._flush_appends()
                appended = None
            upload = self._decode_stager.stage(
                rows, cached, deferred=self.allocator.take_deferred_pages(rows),
                append_values=None if appended is None else appended.values,
            )
            self._deferred_append = None  # the launch wrote it
            # input_ids and append_tokens of this step use what was staged with the batch; an
            # allocate of every known token of these requests right before makes this step's
            # append_tokens a known one (device_len == num_tokens == cached_len + 1)
            self._staged_decode = StagedStep(rows, upload, self._calls if chained else -1, device_lens)
            batch = upload.batch
        elif phase is ForwardPhase.DECODE:  # tables in host memory
            self._flush_appends()
            self._staged_decode = None
            batch = build_decode_batch(self.tables.table, rows, cached, flat_table=flat_table, row_starts=row_starts)
        else:
            self._flush_appends()
            self._staged_decode = None
            self.allocator.flush_deferred_pages()
            batch = build_attention_batch(self.tables.table, rows, cached, device_lens, phase, validate=False)
        if self.attention is not None:
            self.attention.prepare_metadata(batch)
        return batch

    def input_ids(self, batch: AttentionBatch) -> torch.Tensor:
        """Token ids of the batch's new tokens, on the device: shape ``[num_tokens]``, int32.

        For the decode batch just staged on GPU tables, the staging launch wrote them (no call
        here): the result is then a view of the batch's ring slot, valid as long as the batch's
        own tensors (``ring_size`` decode prepares); clone it to keep it longer. Otherwise they
        are gathered from the token pool into a new tensor."""
        staged = self._staged_decode
        if staged is not None and staged.upload.batch is batch:
            # written by the staging launch; a view of the ring slot, valid as long as the batch
            return staged.upload.input_ids
        self._flush_appends()
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
        """Store the new K/V at ``batch.out_loc`` and attend (``BaseAttentionBackend.forward``)."""
        if self.attention is None:
            raise InvalidArgumentError("this backend was created with attention=None; run attention in the host")
        return self.attention.forward(q, k, v, layer_id, batch)

    def append_tokens(self, requests: Sequence[Request], token_ids: torch.Tensor | Sequence[int]) -> None:
        """After a forward that covered every known token: mark it done (``cached_len =
        device_len``) and append one sampled token per request to the token pool (one write).

        After a decode step staged on GPU tables, the write is deferred to the next decode
        ``prepare`` over the same requests, whose launch makes it
        (``kvplug.memory.deferred_appends``): ``token_ids`` is then read on the device later, in
        stream order, and must not be modified in place before that ``prepare``.

        Args:
            token_ids: shape ``[bs]``, int32 (device tensor, stays on the device) or a list of ints.
        """
        self._flush_appends()
        states = self.allocator.states
        rows, row_starts = states.batch_rows(requests)
        if type(token_ids) is torch.Tensor and token_ids.dtype is torch.int32 and token_ids.device == self.device:
            ids = token_ids  # the usual case, sampled ids already in kvplug's form (dim checked below)
        else:
            ids = as_token_ids(token_ids, self.device, allow_empty=True)
        if ids.dim() != 1 or ids.shape[0] != rows.size:
            raise InvalidArgumentError(
                f"need one token id per request: {rows.size} requests, token ids of shape {tuple(ids.shape)}"
            )
        self._calls += 1
        staged, self._staged_decode = self._staged_decode, None
        if staged is not None and staged.rows is not rows:
            staged = None
        chained = staged is not None and staged.chain_call == self._calls - 1
        if chained and staged.device_lens.max() < self.tables.max_seq_len:
            # right after allocate (every token) and a decode prepare of these requests: their
            # lengths are known (device_len == num_tokens == cached_len + 1 == the staged lengths)
            device_lens = num_tokens = staged.device_lens
        else:
            cached, device_lens, num_tokens = states.cached_len[rows], states.device_len[rows], states.num_tokens[rows]
            not_ready = (device_lens != num_tokens) | (device_lens <= cached)
            if np.count_nonzero(not_ready) or (rows.size and num_tokens.max() >= self.tables.max_seq_len):
                reject_append(rows, cached, device_lens, num_tokens, not_ready, self.max_seq_len)
            if staged is not None and np.count_nonzero(staged.upload.device_lens_host - num_tokens):
                staged = None  # lengths changed since that prepare: its append index is not these cells
        # rows are live and num_tokens < max_seq_len <= row width: the flat index is in range
        flat_index = row_starts + num_tokens
        if staged is None:
            self.tables.write_flat(self.tables.token_pool, flat_index, ids)
        elif ids.is_contiguous():  # the next decode prepare of these requests writes it
            self._deferred_append = DeferredAppend(rows, flat_index, staged.upload.append_index, ids)
        else:
            self.tables.write_flat_uploaded(self.tables.token_pool, flat_index, staged.upload.append_index, ids)
        states.cached_len[rows] = device_lens
        states.num_tokens[rows] = num_tokens + 1
        self._appended = (rows, self._calls)

    def cache_unfinished(self, request: Request) -> None:
        """After a non-final prefill chunk's forward: mark it done and move the computed
        page-aligned prefix into the prefix cache (the request keeps using it, locked)."""
        self._calls += 1
        self._flush_appends()
        self.allocator.mark_computed([request])
        self.allocator.cache_request(request, finished=False)

    def finish(self, request: Request, *, computed: bool = False) -> None:
        """End a request: its page-aligned computed prefix goes into the prefix cache, every
        other page back to the free list, its row is freed.

        ``computed=True`` says the last allocated forward (tokens ``cached_len .. device_len``)
        ran though ``append_tokens`` was not called after it, so those tokens may be cached too.
        Leave it ``False`` when aborting before a forward ran: caching unwritten K/V would poison
        the cache.
        """
        self.allocator.check_live(request)
        self._calls += 1
        self._flush_appends()
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
