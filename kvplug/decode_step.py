"""``DecodeStep``: one staged decode step, as an object the host holds from staging to commit.

``KVBackend.begin_decode(requests)`` takes each request's one new token (pages for those that
cross a page boundary), stages the step's batch and input ids (into a CUDA graph's fixed
buffers when the backend has graphs for the batch size, padded with the dummy request) and plans
attention; it returns a ``DecodeStep``. The host runs its forward over ``step.batch`` (or
``DecodeGraphs.run(step)``), samples, and calls ``step.commit(token_ids)``: the forward's K/V
count as cached and each sampled id becomes its request's next token. Device ids are handed to
the page table as one ``PendingTokens`` object (``PageTable.defer_tokens``; the step keeps it as
``pending_tokens``): the table's next ``flush`` takes it once, handing the ids to the next step's
staging launch when it covers the same cells (which writes them and reads them as its input ids)
or writing them. A step is committed once; nothing else carries state from one call to the next.

CUDA graphs (``DecodeGraphs``, below): CUDA-graph decode over ``KVBackend``'s decode steps.

The host gives ``forward_fn(step) -> Tensor``: its whole decode forward (embedding of
``step.input_ids``, every layer's ``backend.forward(q, k, v, layer, step.batch)`` with rotary
embeddings at ``step.positions``, the head), reading its inputs only from the step's device
tensors. ``KVBackend.decode_graphs`` builds this object and captures ``forward_fn`` once per batch
size, largest first, into one graph memory pool, each over a step staged into that size's fixed
buffers (``DecodeStager.stage(..., pad_to=size)``) with every slot the dummy request.

From then on ``begin_decode`` stages a step of ``bs`` live requests into the smallest captured
size ``>= bs``: the same fixed buffers, the live requests first, the dummy request (dummy row,
cached length 0, so its K/V go to the dummy page) in every other slot, and the attention backend
refills its graph buffers (``prepare_for_replay``). ``run(step)`` replays that size's graph and
returns the live rows of its output; a step too big for every graph runs ``forward_fn`` eagerly.

A size's buffers hold one step at a time: ``run`` refuses a step whose buffers a later step of
the same size was staged into (its ``stamp`` is stale). Off CUDA nothing is captured and
``run`` calls ``forward_fn`` over the same padded step, so the padding paths are exercised on
the CPU too.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvplug.interface import AttentionBatch, InvalidArgumentError
from kvplug.memory.page_table import PageTable
from kvplug.memory.pending_tokens import PendingTokens
from kvplug.memory.request import ONE, BatchLease, RequestTable, check_lease
from kvplug.memory.token_ids import as_token_ids, host_token_ids

_max = np.maximum.reduce  # NOTE: ndarray.max without its Python-level wrapper (a per-step call); 1-D arrays only


class DecodeStep:
    """A staged decode step of ``len(requests)`` live requests (see the module docstring).

    Attributes:
        requests: the live requests, in batch order.
        batch: the ``AttentionBatch`` (``batch_size >= len(requests)``: padded with the dummy
            request when staged for a CUDA graph, ``batch.num_padded`` of them last).
        input_ids: shape ``[batch.batch_size]``, int32, device; each request's new token.
        positions: shape ``[batch.batch_size]``, int32, device; its position (= cached length).
        out_loc: shape ``[batch.batch_size]``, int32, device; the pool location its K/V go to.
        graph_size: the captured batch size it was staged for, or ``None`` (eager).
        committed: whether ``commit`` ran.
        pending_tokens: the ``PendingTokens`` its commit handed the page table (device tables),
            else ``None``; ``pending_tokens.taken`` once a flush wrote or passed them on.

    The tensors are views of staging buffers that later steps reuse (a ring of ``ring_size``
    steps, or the graph's fixed buffers for the next step of the same size): run the forward
    before staging more steps than that.
    """

    __slots__ = (
        "requests", "batch", "input_ids", "graph_size", "committed", "stamp", "pending_tokens",
        "_tables", "_states", "_rows", "_generation", "_cached_version", "_cached", "_cells",
    )

    def __init__(
        self,
        tables: PageTable,
        states: RequestTable,
        batch: AttentionBatch,
        rows: np.ndarray,
        cached: np.ndarray,
        cells: np.ndarray,
        graph_size: int | None = None,
        stamp: int = 0,
    ) -> None:
        self.requests = batch.lease.requests
        self.batch = batch
        self.input_ids = batch.input_ids
        self.graph_size = graph_size
        self.committed = False
        self.stamp = stamp
        self.pending_tokens: PendingTokens | None = None
        self._tables = tables
        self._states = states
        self._rows = rows
        self._generation = states.generation  # which requests were live
        self._cached_version = states.cached_version  # which cached lengths were current
        self._cached = cached
        self._cells = cells

    @property
    def positions(self) -> torch.Tensor:
        return self.batch.positions

    @property
    def out_loc(self) -> torch.Tensor:
        return self.batch.out_loc

    @property
    def num_live(self) -> int:
        """Live requests (the batch's first ``num_live`` entries)."""
        return len(self.requests)

    def commit(self, token_ids: torch.Tensor | Sequence[int]) -> None:
        """The forward over this step ran: its K/V count as cached, and ``token_ids[i]`` becomes
        request ``i``'s next token (the next step's input). Requests that reached
        ``max_seq_len`` tokens keep their K/V but store no token (the host finishes them; a
        later ``begin_decode`` refuses them).

        Args:
            token_ids: shape ``[num_live]``, int32: a device tensor stays on the device and is
                read in stream order later (do not modify it in place before the next step is
                staged); host values (a list or CPU tensor) are also known to the host side.

        Raises ``InvalidArgumentError`` (nothing changed) for a second commit, ids of the wrong
        shape, or when a request of the step was finished or moved on since it was staged.
        """
        tables, states = self._tables, self._states
        if self.committed:
            raise InvalidArgumentError("this decode step is already committed")
        device = tables.device
        on_host = not (isinstance(token_ids, torch.Tensor) and token_ids.device.type != "cpu")
        if not on_host and type(token_ids) is torch.Tensor and token_ids.dtype is torch.int32 and token_ids.device == device:
            # sampled ids on the GPU: values are not read here (a sync); host ids are range-checked
            ids = token_ids if token_ids.is_contiguous() else token_ids.contiguous()
        else:
            ids = as_token_ids(token_ids, device, allow_empty=True)
        rows, cached = self._rows, self._cached
        if ids.dim() != 1 or ids.shape[0] != rows.size:
            raise InvalidArgumentError(
                f"need one token id per request: {rows.size} requests, token ids of shape {tuple(ids.shape)}"
            )
        # the same requests are live while no request started or ended (the usual case); else
        # each request's key says whether it is still the one staged. Likewise the cached lengths
        # are compared only when a transition wrote some since staging (another step's commit, a
        # forward). NOTE: RequestTable.cached_version stands in for a per-step gather and compare,
        # so every writer of cached_len must bump it (its transitions do)
        finished = states.generation != self._generation and np.count_nonzero(
            states.key[rows] - np.fromiter((request.key for request in self.requests), np.int64, rows.size)
        )
        if finished or (states.cached_version != self._cached_version
                        and np.count_nonzero(states.cached_len[rows] - cached)):
            raise InvalidArgumentError(
                "a request of this decode step was finished or changed since it was staged; commit a step "
                "before finishing its requests"
            )
        self.committed = True
        cells = self._cells + ONE  # where each sampled id goes
        stored = None
        if _max(cached) > tables.max_seq_len - 2:  # some sampled tokens have no cell: finish those
            stored = cached + 2 <= tables.max_seq_len
            keep = np.flatnonzero(stored)
            if keep.size:
                tables.write_flat(tables._tokens, cells[keep], ids[torch.from_numpy(keep).to(ids.device)])
        elif tables.uses_host_views:
            tables.write_flat(tables._tokens, cells, ids)
        else:
            # the next step's staging launch writes them (and reads them as its input ids)
            append_index = self.batch.append_index
            if append_index.shape[0] != rows.size:  # padded for a graph: the live requests come first
                append_index = append_index[: rows.size]
            pending = self.pending_tokens = PendingTokens(cells, append_index, ids)
            tables.defer_tokens(pending)
        if on_host:
            values = host_token_ids(token_ids, allow_empty=True).numpy()
            target = cells if stored is None else cells[stored]
            tables.host_tokens.reshape(-1)[target] = values if stored is None else values[stored]
        states.decoded(rows, cached, stored, known=on_host)

    def __repr__(self) -> str:
        return (
            f"DecodeStep(requests={self.num_live}, batch_size={self.batch.batch_size}, graph_size={self.graph_size}, "
            f"committed={self.committed})"
        )


# ---------------------------------------------------------------------- CUDA graphs of decode steps

# Which decode batch sizes to capture, and which captured size a batch is padded to. Padding
# uses the dummy request (the page table's last row, every entry the dummy page's first
# location): a padded slot has cached_len 0 and device_len 1, so it writes its K/V to the dummy
# page and attends over that one location, touching nothing a live request owns.


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to ``max_batch_size`` (which is always included)."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise InvalidArgumentError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
    sizes = {bs for bs in (1, 2, 4) if bs <= max_batch_size}
    sizes.update(range(8, max_batch_size + 1, 8))
    sizes.add(max_batch_size)
    return sorted(sizes)


def padded_size(batch_size: int, captured: Sequence[int]) -> int:
    """The smallest captured size >= ``batch_size`` (``captured`` sorted ascending)."""
    if not captured:
        raise InvalidArgumentError("no CUDA graph is captured (call capture() first, or after teardown())")
    position = bisect.bisect_left(captured, batch_size)
    if batch_size < 1 or position == len(captured):
        raise InvalidArgumentError(
            f"decode batch size {batch_size} is outside the captured sizes 1..{captured[-1]}; run it eagerly"
        )
    return captured[position]


logger = logging.getLogger("kvplug.graphs")

ForwardFn = Callable[[DecodeStep], torch.Tensor]
Progress = Callable[[int, int, int], None]


class DecodeGraphs:
    """Decode graphs of one ``KVBackend`` (built by ``KVBackend.decode_graphs``; see the module
    docstring).

    Attributes:
        batch_sizes: the captured sizes, ascending.
        uses_cuda_graphs: ``True`` on CUDA (replays), ``False`` elsewhere (eager over the same buffers).
        capture_seconds: wall time the capture took.
        capture_bytes: device memory the graphs' pool took (CUDA), else 0.
    """

    def __init__(
        self,
        backend: Any,
        forward_fn: ForwardFn,
        *,
        batch_sizes: Sequence[int] | None,
        max_batch_size: int,
        progress: Progress | None = None,
    ) -> None:
        if not callable(forward_fn):
            raise InvalidArgumentError(f"forward_fn must be callable, got {type(forward_fn).__name__}")
        rows = backend.max_running_reqs
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or not 1 <= max_batch_size <= rows:
            raise InvalidArgumentError(
                f"max_batch_size must be an int in [1, max_running_reqs={rows}], got {max_batch_size!r}"
            )
        if batch_sizes is None:
            sizes = default_batch_sizes(max_batch_size)
        else:
            try:
                sizes = sorted({int(size) for size in batch_sizes})
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"batch_sizes must be ints, got {batch_sizes!r}") from None
        if not sizes or sizes[0] < 1 or sizes[-1] > rows:
            raise InvalidArgumentError(f"batch sizes must lie in [1, max_running_reqs={rows}], got {sizes}")
        self.backend = backend
        self.forward_fn = forward_fn
        self.batch_sizes = sizes
        self.uses_cuda_graphs = backend.device.type == "cuda"
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self._progress = progress or (
            lambda done, total, bs: logger.debug("captured decode graph bs=%d (%d/%d)", bs, done, total)
        )
        self._graphs: dict[int, Any] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._stamps = {size: 0 for size in sizes}
        self._active = False

    # ---------------------------------------------------------------- staging (KVBackend's side)
    def size_for(self, batch_size: int) -> int | None:
        """The captured size a step of ``batch_size`` live requests is padded to, or ``None``
        (too big: eager)."""
        if not self._active or batch_size > self.batch_sizes[-1]:
            return None
        return padded_size(batch_size, self.batch_sizes)

    def claim(self, size: int) -> int:
        """``size``'s buffers are being staged with a new step: its stamp."""
        stamp = self._stamps[size] = self._stamps[size] + 1
        return stamp

    # ---------------------------------------------------------------- capture
    def capture(self) -> None:
        """Capture every size, largest first, into one graph memory pool."""
        backend = self.backend
        attention = backend.attention
        attention.init_capture_graph(backend.max_seq_len, self.batch_sizes)
        started = time.perf_counter()
        pool = None
        if self.uses_cuda_graphs:
            pool = torch.cuda.graph_pool_handle()
            torch.cuda.synchronize(backend.device)
            before = torch.cuda.memory_allocated(backend.device)
        for done, size in enumerate(reversed(self.batch_sizes), start=1):
            step = self._dummy_step(size)
            attention.prepare_for_capture(step.batch)
            if self.uses_cuda_graphs:
                self._graphs[size], self._outputs[size] = self._capture_one(step, pool)
            self._progress(done, len(self.batch_sizes), size)
        if self.uses_cuda_graphs:
            torch.cuda.synchronize(backend.device)
            self.capture_bytes = max(torch.cuda.memory_allocated(backend.device) - before, 0)
        self.capture_seconds = time.perf_counter() - started
        self._active = True
        logger.debug(  # hosts log the capture their way (``capture_seconds``, ``capture_bytes``)
            "captured %d decode graphs (batch sizes %s) in %.2f s, %.1f MiB",
            len(self.batch_sizes), _describe_sizes(self.batch_sizes), self.capture_seconds, self.capture_bytes / 2**20,
        )

    def _dummy_step(self, size: int) -> DecodeStep:
        """A step of ``size`` dummy requests staged into ``size``'s fixed buffers (capture only:
        the dummy request writes only the dummy page)."""
        backend = self.backend
        empty = np.empty(0, dtype=np.int64)
        batch = backend.stager.stage(empty, empty, pad_to=size)
        batch.lease = BatchLease(backend.requests, backend.requests.generation, ())
        return DecodeStep(backend.tables, backend.requests, batch, empty, empty, empty, size, self.claim(size))

    def _capture_one(self, step: DecodeStep, pool: Any) -> tuple[Any, torch.Tensor]:
        side = torch.cuda.Stream(self.backend.device)
        side.wait_stream(torch.cuda.current_stream(self.backend.device))
        with torch.cuda.stream(side):  # warm-up: JIT compiles and lazy allocations stay out of the graph
            self.forward_fn(step)
        torch.cuda.current_stream(self.backend.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: a host's other threads (an HTTP server's) may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            output = self.forward_fn(step)
        if not isinstance(output, torch.Tensor) or output.dim() < 1 or output.shape[0] != step.batch.batch_size:
            raise InvalidArgumentError(
                f"forward_fn must return a tensor with one row per batch entry ({step.batch.batch_size}), got "
                f"{getattr(output, 'shape', type(output).__name__)}"
            )
        return graph, output

    # ---------------------------------------------------------------- replay
    def run(self, step: DecodeStep) -> torch.Tensor:
        """``forward_fn``'s output for ``step``'s live requests (its first ``step.num_live``
        rows): a replay when the step was staged for a graph (a view of graph memory that the
        next replay of the size overwrites: copy it to keep it), else ``forward_fn(step)``."""
        if not isinstance(step, DecodeStep) or step._states is not self.backend.requests:
            raise InvalidArgumentError("run() takes a DecodeStep of this backend (from begin_decode)")
        size = step.graph_size
        if size is None:
            return self.forward_fn(step)
        if not self._active or self._stamps.get(size) != step.stamp:
            raise InvalidArgumentError(
                f"this step's graph buffers (batch size {size}) were staged again by a later step, or the graphs "
                "were released; run each step before staging the next one of its size"
            )
        if step.committed:
            raise InvalidArgumentError("this decode step is already committed; stage a new one")
        lease = step.batch.lease
        if lease is not None and lease.generation != lease.states.generation:
            check_lease(lease, lease.states)  # a finished request's page may be another's now
        graph = self._graphs.get(size)
        if graph is None:
            return self.forward_fn(step)[: step.num_live]
        graph.replay()
        return self._outputs[size][: step.num_live]

    def release(self) -> None:
        """Drop every graph and its memory; ``begin_decode`` stages eager steps again."""
        self._active = False
        self._graphs.clear()
        self._outputs.clear()
        if self.backend.graphs is self:
            self.backend.graphs = None

    def __repr__(self) -> str:
        return f"DecodeGraphs(batch_sizes={_describe_sizes(self.batch_sizes)}, cuda_graphs={self.uses_cuda_graphs})"


def _describe_sizes(sizes: Sequence[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]} ({len(sizes)})"
