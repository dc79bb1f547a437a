"""The ``DECODE`` fast path of batch building, and the host buffers every batch is staged in.

One new token per request means positions are the cached lengths, ``extend_start`` is ``0 .. bs``
and ``out_loc`` is one cell per row, so the host work is a few O(batch) numpy writes into one
int32 host buffer (pinned on CUDA), moved to the device in a single copy. ``KVBackend.prepare``
calls ``build_decode_batch`` directly (its lengths are valid by construction);
``build_attention_batch`` validates and then takes it for decode batches.
"""

from __future__ import annotations

import numpy as np
import torch

from kvplug.interface import AttentionBatch, ForwardPhase


def build_decode_batch(
    page_table: torch.Tensor,
    table_rows: np.ndarray,
    cached_lens: np.ndarray,
    *,
    num_padded: int = 0,
    flat_table: torch.Tensor | np.ndarray | None = None,
    row_starts: np.ndarray | None = None,
) -> AttentionBatch:
    """The ``DECODE`` batch ``build_attention_batch`` returns for ``device_lens = cached_lens + 1``,
    field for field, without validating anything (the caller guarantees what
    ``build_attention_batch`` checks: a contiguous int32 table of fewer than 2**31 entries, live rows
    in range and distinct, padding on the dummy row, ``0 <= cached_len < row_width``).

    Args:
        page_table: shape ``[max_running_reqs + 1, row_width]``, int32, device.
        table_rows: shape ``[bs]``, int64, host (numpy).
        cached_lens: shape ``[bs]``, int64, host (numpy); the new token's position.
        num_padded: trailing requests that are CUDA-graph padding (on the dummy row).
        flat_table: ``page_table.view(-1)`` from a caller that keeps one (making it costs ~1 us);
            for a CPU table its numpy view, so ``out_loc`` is gathered by numpy into the buffer.
        row_starts: shape ``[bs]``, int64, host; ``table_rows * row_width``, from a caller that
            keeps it.
    """
    bs = table_rows.shape[0]
    # host layout: rows | cached | device | positions | table index or out_loc | extend_start (bs + 1)
    sizes = (bs, bs, bs, bs, bs, bs + 1)
    host_tensor, host = _host_arrays(6 * bs + 1, page_table.device)
    block = host[: 5 * bs].reshape(5, bs)
    block[0] = table_rows
    block[1::2] = cached_lens  # cached lengths, and positions: the new token sits at cached_len
    np.add(cached_lens, 1, out=block[2], casting="unsafe")
    host[5 * bs :] = np.arange(bs + 1, dtype=np.int32)
    if row_starts is None:
        row_starts = table_rows * page_table.shape[1]
    if isinstance(flat_table, np.ndarray):  # host memory: gather out_loc here, no device op
        block[4] = flat_table[row_starts + cached_lens]
        views = host_tensor.split_with_sizes(sizes)
        d_rows, d_cached, d_device, d_positions, out_loc, d_start = views
        return AttentionBatch(
            ForwardPhase.DECODE, d_rows, d_cached, d_device, d_cached, d_device, d_start, d_start, d_positions,
            out_loc, page_table, num_padded,
        )
    block[4] = row_starts + cached_lens
    on_device = host_tensor.to(page_table.device, non_blocking=True)
    views = on_device.split_with_sizes(sizes)
    d_rows, d_cached, d_device, d_positions, d_index, d_start = views
    _, h_cached, h_device, _, _, h_start = host_views(host_tensor, on_device, views, sizes)
    out_loc = (page_table.view(-1) if flat_table is None else flat_table).index_select(0, d_index)
    return AttentionBatch(
        ForwardPhase.DECODE, d_rows, d_cached, d_device, h_cached, h_device, d_start, h_start, d_positions,
        out_loc, page_table, num_padded,
    )


def host_views(host_tensor: torch.Tensor, on_device: torch.Tensor, device_views: tuple, sizes: tuple) -> tuple:
    """The host buffer split like the device copy (on a CPU table the copy *is* the buffer)."""
    return device_views if on_device is host_tensor else host_tensor.split_with_sizes(sizes)


def host_buffer(size: int, device: torch.device) -> torch.Tensor:
    """A fresh int32 host buffer of ``size`` for a copy to ``device``: pinned for CUDA (from
    torch's caching host allocator, so the copy is truly asynchronous and the block is not
    reused before the copy finishes), plain memory otherwise."""
    return torch.empty(size, dtype=torch.int32, pin_memory=device.type == "cuda")


def _host_arrays(size: int, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
    """``host_buffer(size, device)`` and a numpy view of it (cheapest from numpy off CUDA)."""
    if device.type == "cuda":
        tensor = host_buffer(size, device)
        return tensor, tensor.numpy()
    array = np.empty(size, dtype=np.int32)
    return torch.from_numpy(array), array
