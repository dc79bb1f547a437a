"""CUDA-graph decode: capture the host's per-step forward once per batch size, then replay.

The host supplies ``forward_fn(batch) -> Tensor``: its whole decode step (embedding, every
layer's ``backend.forward(q, k, v, layer, batch)``, head), reading its inputs only from the
batch's device tensors (``table_rows``, ``positions``, ...; token ids come from the host's token
pool on the device). The runner owns those tensors: one packed int32 buffer per captured size,
refilled by one host-to-device copy per replay; the page-table gather that yields ``out_loc`` is
the graph's first node. Sizes are captured largest first into one shared memory pool.

A batch smaller than a captured size is padded with the dummy request (see ``graph_padding``).
Off CUDA the runner keeps the same buffers and calls but re-executes ``forward_fn`` instead of
replaying a graph, so hosts and tests exercise the same path on CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvplug.attention.batch import host_buffer, validate_lengths
from kvplug.attention.graph_padding import decode_input_layout, default_batch_sizes, padded_decode_inputs, padded_size
from kvplug.interface import AttentionBatch, BaseAttentionBackend, ForwardPhase, InvalidArgumentError
from kvplug.memory.ragged import HostInts, host_ints

logger = logging.getLogger(__name__)

ForwardFn = Callable[[AttentionBatch], torch.Tensor]
Progress = Callable[[int, int, int], None]


@dataclass
class _Captured:
    """One captured size: its graph (``None`` off CUDA), static batch, packed inputs and output."""

    graph: Any
    batch: AttentionBatch
    inputs: torch.Tensor  # [6 * bs + 1], int32, device: decode_input_layout(bs)
    table_index: torch.Tensor  # [bs], int32, device; view of inputs
    output: torch.Tensor | None


class GraphRunner:
    """Decode CUDA graphs for ``batch_sizes`` (default: 1, 2, 4, multiples of 8 up to
    ``max_batch_size``) over ``backend`` and ``page_table``.

    Args:
        backend: the attention backend ``forward_fn`` calls (its graph methods are used).
        page_table: shape ``[max_running_reqs + 1, row_width]``, int32, device; last row dummy.
        forward_fn: the host's decode step, see the module docstring.
        max_batch_size: largest batch captured.
        max_seq_len: longest ``device_len`` a replayed request may have (<= row width).
        progress: called as ``progress(done, total, batch_size)`` after each capture; logs if None.
    """

    def __init__(
        self,
        backend: BaseAttentionBackend,
        page_table: torch.Tensor,
        forward_fn: ForwardFn,
        *,
        max_batch_size: int,
        max_seq_len: int,
        batch_sizes: Sequence[int] | None = None,
        progress: Progress | None = None,
    ) -> None:
        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.dtype != torch.int32:
            raise InvalidArgumentError("page_table must be a 2-D int32 tensor [max_running_reqs + 1, row_width]")
        num_rows, width = page_table.shape
        if not 0 < max_seq_len <= width:
            raise InvalidArgumentError(f"max_seq_len must be in [1, {width}] (the row width), got {max_seq_len}")
        sizes = sorted(set(default_batch_sizes(max_batch_size) if batch_sizes is None else batch_sizes))
        if not sizes or sizes[0] < 1 or sizes[-1] > max_batch_size or max_batch_size > num_rows - 1:
            raise InvalidArgumentError(
                f"batch sizes must lie in [1, max_batch_size={max_batch_size}] and max_batch_size may not exceed "
                f"the {num_rows - 1} request rows of the table; got {sizes}"
            )
        self.backend = backend
        self.page_table = page_table
        self.forward_fn = forward_fn
        self.batch_sizes = sizes
        self.max_seq_len = int(max_seq_len)
        self.uses_cuda_graphs = page_table.device.type == "cuda"
        self._dummy_row = num_rows - 1
        self._progress = progress or (lambda done, total, bs: logger.info("captured decode graph bs=%d (%d/%d)", bs, done, total))
        self._captured: dict[int, _Captured] = {}
        self._captured_sizes: list[int] = []

    # ---------------------------------------------------------------- capture
    def capture(self) -> None:
        """Capture every size, largest first, sharing one graph memory pool."""
        self.teardown()
        self.backend.init_capture_graph(self.max_seq_len, self.batch_sizes)
        pool = torch.cuda.graph_pool_handle() if self.uses_cuda_graphs else None
        for done, bs in enumerate(reversed(self.batch_sizes), start=1):
            self._captured[bs] = self._capture_one(bs, pool)
            self._progress(done, len(self.batch_sizes), bs)
        self._captured_sizes = sorted(self._captured)

    def _capture_one(self, bs: int, pool: Any) -> _Captured:
        empty = np.empty(0, dtype=np.int64)
        packed = padded_decode_inputs(empty, empty, bs, self._dummy_row, self.page_table.shape[1])
        host = torch.from_numpy(packed)
        inputs = host.to(self.page_table.device)
        rows, cached, device, extend_start, positions, table_index = inputs.split_with_sizes(decode_input_layout(bs))
        _, host_cached, host_device, host_start, _, _ = host.split_with_sizes(decode_input_layout(bs))
        out_loc = torch.empty(bs, dtype=torch.int32, device=self.page_table.device)
        batch = AttentionBatch(
            ForwardPhase.DECODE, rows, cached, device, host_cached, host_device, extend_start, host_start,
            positions, out_loc, self.page_table, num_padded=bs - 1,
        )
        self.backend.prepare_for_capture(batch)
        entry = _Captured(None, batch, inputs, table_index, None)
        if not self.uses_cuda_graphs:
            return entry
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: JIT compiles and lazy allocations stay out of the graph
            self._step(entry)
        torch.cuda.current_stream().wait_stream(side)
        entry.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(entry.graph, pool=pool):
            entry.output = self._step(entry)
        return entry

    def _step(self, entry: _Captured) -> torch.Tensor:
        torch.index_select(self.page_table.view(-1), 0, entry.table_index, out=entry.batch.out_loc)
        return self.forward_fn(entry.batch)

    # ---------------------------------------------------------------- replay
    def can_use_graph(self, batch: AttentionBatch) -> bool:
        """True for a decode batch no larger than the largest captured size."""
        return bool(self._captured_sizes) and batch.is_decode and batch.batch_size <= self._captured_sizes[-1]

    def replay(self, table_rows: HostInts, cached_lens: HostInts, device_lens: HostInts) -> torch.Tensor:
        """Run one decode step for the given requests (host values, as for
        ``build_attention_batch``) through the smallest captured graph that fits.

        Returns ``forward_fn``'s output for the live requests (its first ``bs`` rows). On CUDA it
        is a view of graph memory that the next replay overwrites: copy it to keep it.

        Raises:
            InvalidArgumentError: nothing captured, a batch above the largest captured size, a
                request that is not a one-token decode, or bad rows/lengths.
        """
        rows = host_ints(table_rows, "table_rows")
        cached = host_ints(cached_lens, "cached_lens")
        device = host_ints(device_lens, "device_lens")
        bs = rows.shape[0]
        padded = padded_size(bs, self._captured_sizes)
        validate_lengths(rows, cached, device, ForwardPhase.DECODE, 0, self.page_table.shape[0], self.max_seq_len)
        entry = self._captured[padded]
        host = host_buffer(entry.inputs.shape[0], self.page_table.device)
        host.numpy()[:] = padded_decode_inputs(rows, cached, padded, self._dummy_row, self.page_table.shape[1])
        entry.inputs.copy_(host, non_blocking=True)
        _, host_cached, host_device, host_start, _, _ = host.split_with_sizes(decode_input_layout(padded))
        batch = entry.batch
        batch.cached_lens_cpu, batch.device_lens_cpu, batch.extend_start_cpu = host_cached, host_device, host_start
        batch.num_padded = padded - bs
        self.backend.prepare_for_replay(batch)
        if entry.graph is None:
            return self._step(entry)[:bs]
        entry.graph.replay()
        return entry.output[:bs]

    def teardown(self) -> None:
        """Drop every graph and its memory (the pool is freed once no graph uses it)."""
        self._captured.clear()
        self._captured_sizes = []
