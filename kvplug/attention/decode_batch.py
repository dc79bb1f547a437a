"""The ``DECODE`` fast path of batch building, and the host buffers every batch is staged in.

One new token per request means positions are the cached lengths, ``extend_start`` is ``0 .. bs``
and ``out_loc`` is one cell per row, so the host work is a few O(batch) numpy writes. For a table
in host memory ``build_decode_batch`` makes every field a view of one numpy-filled buffer; for a
table used through torch (a GPU's) it takes ``kvplug.attention.decode_staging`` (one upload, one
kernel). ``KVBackend.prepare`` calls these directly (its lengths are valid by construction);
``build_attention_batch`` validates and then takes ``build_decode_batch`` for decode batches.
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
        flat_table: ``page_table.view(-1)`` from a caller that keeps one (making a view is a torch call);
            for a CPU table its numpy view, so ``out_loc`` is gathered by numpy into the buffer.
        row_starts: shape ``[bs]``, int64, host; ``table_rows * row_width``, from a caller that
            keeps it.
    """
    bs = table_rows.shape[0]
    if not isinstance(flat_table, np.ndarray):
        # a table used through torch: one fresh buffer the batch owns (KVBackend's per-step path
        # is DecodeStager), one copy, the out_loc gather on the device
        host_tensor = host_buffer(4 * bs + 1, page_table.device)
        block = host_tensor.numpy()[: 3 * bs].reshape(3, bs)
        block[0] = table_rows
        block[1] = cached_lens
        np.add(cached_lens, 1, out=block[2], casting="unsafe")
        host_tensor.numpy()[3 * bs :] = np.arange(bs + 1, dtype=np.int32)
        on_device = host_tensor.to(page_table.device, non_blocking=True)
        sizes = (bs, bs, bs, bs + 1)
        views = rows, cached, device, start = on_device.split_with_sizes(sizes)
        _, h_cached, h_device, h_start = host_views(host_tensor, on_device, views, sizes)
        flat = page_table.view(-1) if flat_table is None else flat_table
        out_loc = flat.index_select(0, torch.add(cached, rows, alpha=page_table.shape[1]))
        return AttentionBatch(
            ForwardPhase.DECODE, rows, cached, device, h_cached, h_device, start, h_start, cached, out_loc,
            page_table, num_padded,
        )
    # host memory: every field is a view of one numpy-filled buffer, out_loc gathered by numpy
    host = np.empty(5 * bs + 1, dtype=np.int32)
    block = host[: 4 * bs].reshape(4, bs)
    block[0] = table_rows
    block[1] = cached_lens
    np.add(cached_lens, 1, out=block[2], casting="unsafe")
    block[3] = flat_table[(table_rows * page_table.shape[1] if row_starts is None else row_starts) + cached_lens]
    host[4 * bs :] = np.arange(bs + 1, dtype=np.int32)
    rows, cached, device, out_loc, start = torch.from_numpy(host).split_with_sizes((bs, bs, bs, bs, bs + 1))
    return AttentionBatch(
        ForwardPhase.DECODE, rows, cached, device, cached, device, start, start, cached, out_loc, page_table, num_padded
    )


class ExtendStarts:
    """A decode batch's ``extend_start``, ``0 .. bs``, on the device and on the host, made once
    per batch size and shared by every batch of that size (no one writes into it), so a decode
    step neither writes nor uploads it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._by_size: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(device, host)``: shape ``[batch_size + 1]``, int32, each."""
        pair = self._by_size.get(batch_size)
        if pair is None:
            host = torch.arange(batch_size + 1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            pair = self._by_size[batch_size] = (host.to(self.device, non_blocking=True), host)
        return pair


def host_views(host_tensor: torch.Tensor, on_device: torch.Tensor, device_views: tuple, sizes: tuple) -> tuple:
    """The host buffer split like the device copy (on a CPU table the copy *is* the buffer)."""
    return device_views if on_device is host_tensor else host_tensor.split_with_sizes(sizes)


def host_buffer(size: int, device: torch.device) -> torch.Tensor:
    """A fresh int32 host buffer of ``size`` for a copy to ``device``: pinned for CUDA (from
    torch's caching host allocator, so the copy is truly asynchronous and the block is not
    reused before the copy finishes), plain memory otherwise."""
    return torch.empty(size, dtype=torch.int32, pin_memory=device.type == "cuda")
