"""The ``DECODE`` fast path of batch building, and the host buffers every batch is staged in.

One new token per request means positions are the cached lengths, ``extend_start`` is ``0 .. bs``
and ``out_loc`` is one cell per row, so the host work is a few O(batch) numpy writes into one
int32 host buffer (pinned on CUDA), moved to the device in a single copy. ``KVBackend.prepare``
calls these directly (its lengths are valid by construction); on a GPU table it takes
``stage_decode_batch`` and keeps the two flat indices uploaded with the batch, so ``input_ids``
and ``append_tokens`` need no copy of their own. ``build_attention_batch`` validates and then
takes ``build_decode_batch`` for decode batches.

On a GPU host every torch call costs 7-15 us of host time whatever its size, so the per-step cost
is set by the number of calls: one buffer, one copy, one split, one gather.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvplug.interface import AttentionBatch, ForwardPhase


class DecodeUpload(NamedTuple):
    """A decode batch and the two flat indices staged with it.

    Attributes:
        batch: the ``AttentionBatch``.
        token_index: shape ``[bs]``, int32, table device; ``row * row_width + cached_len``, the
            cell of each request's new token in the page table and the token pool (``input_ids``).
        append_index: shape ``[bs]``, int64, table device; the next cell, ``row * row_width +
            cached_len + 1``, where the sampled token goes (``append_tokens``).
        append_index_host: shape ``[bs]``, int64, host (numpy); the same values.
    """

    batch: AttentionBatch
    token_index: torch.Tensor
    append_index: torch.Tensor
    append_index_host: np.ndarray


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
    if not isinstance(flat_table, np.ndarray):
        return stage_decode_batch(
            page_table, table_rows, cached_lens, num_padded=num_padded, flat_table=flat_table, row_starts=row_starts
        ).batch
    # host memory: every field is a view of one numpy-filled buffer, out_loc gathered by numpy
    bs = table_rows.shape[0]
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
    per batch size and shared by every batch of that size (no one writes into it): one fewer
    host write, and one fewer piece of the step's upload to split."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._by_size: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(device, host)``: shape ``[batch_size + 1]``, int32, each."""
        pair = self._by_size.get(batch_size)
        if pair is None:
            host = torch.arange(batch_size + 1, dtype=torch.int32)
            pair = self._by_size[batch_size] = (host.to(self.device), host)
        return pair


def stage_decode_batch(
    page_table: torch.Tensor,
    table_rows: np.ndarray,
    cached_lens: np.ndarray,
    *,
    num_padded: int = 0,
    flat_table: torch.Tensor | None = None,
    row_starts: np.ndarray | None = None,
    out_loc: torch.Tensor | None = None,
    extend_starts: ExtendStarts | None = None,
) -> DecodeUpload:
    """``build_decode_batch`` for a table used through torch (a GPU's): the batch and the step's
    two flat indices, staged in one host buffer and moved to the device in one copy.

    Args:
        page_table, table_rows, cached_lens, num_padded, row_starts: as ``build_decode_batch``.
        flat_table: ``page_table.view(-1)`` from a caller that keeps one.
        out_loc: shape ``[bs]``, int32, table device; ``page_table[table_rows, cached_lens]``
            from a caller that already holds it (the pages it just allocated), saving the gather.
        extend_starts: the caller's ``ExtendStarts`` for the table's device (one is made for
            this call otherwise).
    """
    bs = table_rows.shape[0]
    # host layout: append index (bs int64 = 2 * bs int32, first so it is 8-byte aligned) | rows |
    # cached = positions | device | token index
    host_tensor, host = _host_arrays(6 * bs, page_table.device)
    if row_starts is None:
        row_starts = table_rows * page_table.shape[1]
    block = host[2 * bs :].reshape(4, bs)
    block[0] = table_rows
    block[1] = cached_lens
    np.add(cached_lens, 1, out=block[2], casting="unsafe")
    np.add(row_starts, cached_lens, out=block[3], casting="unsafe")
    append_host = host[: 2 * bs].view(np.int64)
    np.add(block[3], 1, out=append_host)
    on_device = host_tensor.to(page_table.device, non_blocking=True)
    append, d_rows, d_cached, d_device, d_index = on_device.split_with_sizes((2 * bs, bs, bs, bs, bs))
    d_start, h_start = (extend_starts or ExtendStarts(page_table.device)).get(bs)
    if on_device is host_tensor:  # a CPU table used through torch (tests): views of one buffer
        h_cached, h_device = d_cached, d_device
    else:  # views of the pinned buffer (which they keep alive); from_numpy is the cheapest way
        h_cached, h_device = torch.from_numpy(block[1]), torch.from_numpy(block[2])
    if out_loc is None:
        out_loc = (page_table.view(-1) if flat_table is None else flat_table).index_select(0, d_index)
    batch = AttentionBatch(
        ForwardPhase.DECODE, d_rows, d_cached, d_device, h_cached, h_device, d_start, h_start, d_cached,
        out_loc, page_table, num_padded,
    )
    return DecodeUpload(batch, d_index, append.view(torch.int64), append_host)


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
