"""``DecodeGraphs``: CUDA-graph decode over ``KVBackend``'s decode steps.

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

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from kvplug.attention.graph_padding import default_batch_sizes, padded_size
from kvplug.batch_lease import BatchLease, check_lease
from kvplug.decode_step import DecodeStep
from kvplug.interface import InvalidArgumentError

if TYPE_CHECKING:
    from kvplug.backend import KVBackend

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
        backend: "KVBackend",
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
        import numpy as np

        backend = self.backend
        empty = np.empty(0, dtype=np.int64)
        batch = backend.stager.stage(empty, empty, pad_to=size)
        batch.lease = BatchLease(backend.requests, backend.requests.generation, ())
        return DecodeStep(backend.tables, backend.requests, batch, empty, empty, size, self.claim(size))

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
