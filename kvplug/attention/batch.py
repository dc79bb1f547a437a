"""Building one step's ``AttentionBatch`` from host-side request lengths, without a Python loop
over tokens.

Every per-request quantity is computed on the host with numpy (microseconds at batch 256), packed
into one int32 host buffer (pinned on CUDA) and moved to the device in a single copy; ``out_loc`` is then one
gather from the page table on the device. The batch's ``*_cpu`` fields are views of that host
buffer, which is fresh for every call, so a batch never changes under a caller that keeps it.

Decode batches take the fast path in ``kvplug.attention.decode_batch`` (re-exported here, with
``host_buffer``), after validation.
"""

from __future__ import annotations

import numpy as np
import torch

from kvplug.attention.decode_batch import build_decode_batch, host_buffer, host_views
from kvplug.interface import AttentionBatch, ForwardPhase, InvalidArgumentError
from kvplug.memory.ragged import HostInts, host_ints

__all__ = ["HostInts", "build_attention_batch", "build_decode_batch", "host_buffer"]


def build_attention_batch(
    page_table: torch.Tensor,
    table_rows: HostInts,
    cached_lens: HostInts,
    device_lens: HostInts,
    phase: ForwardPhase,
    *,
    num_padded: int = 0,
    validate: bool = True,
) -> AttentionBatch:
    """Describe one forward step over ``page_table``.

    Request ``i`` lives in table row ``table_rows[i]``; its tokens ``cached_lens[i] ..
    device_lens[i] - 1`` are computed in this step and their K/V go to
    ``page_table[table_rows[i], cached_lens[i]:device_lens[i]]``.

    Args:
        page_table: shape ``[max_running_reqs + 1, row_width]``, int32, device; the last row is
            the dummy request's.
        table_rows: shape ``[bs]``, integers, host (list, numpy array or CPU tensor).
        cached_lens: shape ``[bs]``, integers, host; tokens whose K/V are already in the pool.
        device_lens: shape ``[bs]``, integers, host; tokens each request attends to after this step.
        phase: ``DECODE`` requires exactly one new token per request.
        num_padded: trailing requests that are CUDA-graph padding; they must use the dummy row.
        validate: check rows and lengths (about a dozen numpy reductions). An engine whose
            scheduler already guarantees them may pass ``False`` to save that host time; bad
            values then corrupt the pool instead of raising.

    Raises:
        InvalidArgumentError: mismatched lengths, a row out of the table (or a live request on the
            dummy row, or twice in the batch), ``cached_len < 0``, ``device_len <= cached_len``,
            ``device_len`` past the row width, or a decode request with more than one new token.
    """
    _check_table(page_table)
    if not isinstance(phase, ForwardPhase):
        raise InvalidArgumentError(f"phase must be a ForwardPhase, got {phase!r}")
    rows = host_ints(table_rows, "table_rows")
    cached = host_ints(cached_lens, "cached_lens")
    device = host_ints(device_lens, "device_lens")
    num_rows, row_width = page_table.shape
    if validate:
        extend = validate_lengths(rows, cached, device, phase, num_padded, num_rows, row_width)
    else:
        extend = device - cached
    if phase is ForwardPhase.DECODE:
        return build_decode_batch(page_table, rows, cached, num_padded=num_padded)

    bs = rows.shape[0]
    num_tokens = int(extend.sum())
    # host layout: rows | cached | device | extend_start (bs + 1) | positions (n) | table index (n)
    sizes = (bs, bs, bs, bs + 1, num_tokens, num_tokens)
    host_tensor = host_buffer(4 * bs + 1 + 2 * num_tokens, page_table.device)
    host = host_tensor.numpy()
    host[:bs] = rows
    host[bs : 2 * bs] = cached
    host[2 * bs : 3 * bs] = device
    extend_start = host[3 * bs : 4 * bs + 1]
    extend_start[0] = 0
    extend_start[1:] = np.cumsum(extend)
    positions = host[4 * bs + 1 : 4 * bs + 1 + num_tokens]
    # token t of request i sits at cached[i] + (t - extend_start[i])
    positions[:] = np.arange(num_tokens) + np.repeat(cached - extend_start[:-1], extend)
    host[4 * bs + 1 + num_tokens :] = np.repeat(rows * row_width, extend) + positions

    on_device = host_tensor.to(page_table.device, non_blocking=True)
    views = on_device.split_with_sizes(sizes)
    d_rows, d_cached, d_device, d_start, d_positions, d_index = views
    _, h_cached, h_device, h_start, _, _ = host_views(host_tensor, on_device, views, sizes)
    return AttentionBatch(
        phase=phase,
        table_rows=d_rows,
        cached_lens=d_cached,
        device_lens=d_device,
        cached_lens_cpu=h_cached,
        device_lens_cpu=h_device,
        extend_start=d_start,
        extend_start_cpu=h_start,
        positions=d_positions,
        out_loc=page_table.view(-1).index_select(0, d_index),
        page_table=page_table,
        num_padded=num_padded,
    )


def _check_table(page_table: torch.Tensor) -> None:
    if not isinstance(page_table, torch.Tensor):
        raise InvalidArgumentError(f"page_table must be a torch.Tensor, got {type(page_table).__name__}")
    if page_table.dim() != 2 or page_table.dtype != torch.int32 or not page_table.is_contiguous():
        raise InvalidArgumentError(
            "page_table must be a contiguous 2-D int32 tensor [max_running_reqs + 1, row_width], got "
            f"shape {tuple(page_table.shape)}, {page_table.dtype}, contiguous={page_table.is_contiguous()}"
        )
    if page_table.numel() >= 2**31:
        raise InvalidArgumentError(f"page_table has {page_table.numel()} entries; at most 2**31 - 1 are supported")


def validate_lengths(
    rows: np.ndarray,
    cached: np.ndarray,
    device: np.ndarray,
    phase: ForwardPhase,
    num_padded: int,
    num_rows: int,
    row_width: int,
) -> np.ndarray:
    """Check one batch's host-side rows and lengths; return the extend lengths.

    Args:
        rows, cached, device: shape ``[bs]``, int64, cpu (numpy): table rows, cached and device lengths.
        phase: decode requires exactly one new token per request, prefill at least one.
        num_padded: trailing dummy requests (they may use the dummy row ``num_rows - 1``).
        num_rows, row_width: the page table's shape.

    Raises ``InvalidArgumentError`` saying what was expected and what was given; nothing is modified.
    """
    bs = rows.shape[0]
    if bs == 0 or cached.shape[0] != bs or device.shape[0] != bs:
        raise InvalidArgumentError(
            "table_rows, cached_lens and device_lens must have the same non-zero length, got "
            f"{rows.shape[0]}, {cached.shape[0]}, {device.shape[0]}"
        )
    if isinstance(num_padded, bool) or not isinstance(num_padded, int) or not 0 <= num_padded < bs:
        raise InvalidArgumentError(f"num_padded must be an int in [0, {bs}), got {num_padded!r}")
    live = rows[: bs - num_padded]
    dummy_row = num_rows - 1
    if live.min() < 0 or live.max() >= dummy_row:
        raise InvalidArgumentError(
            f"table_rows of live requests must lie in [0, {dummy_row}) (row {dummy_row} is the dummy "
            f"request's), got values in [{live.min()}, {live.max()}]"
        )
    if num_padded and (rows[bs - num_padded :] != dummy_row).any():
        raise InvalidArgumentError(f"the {num_padded} padded requests must use the dummy row {dummy_row}")
    if np.bincount(live, minlength=1).max() > 1:
        raise InvalidArgumentError(f"a table row appears twice among the live requests: {live.tolist()}")
    extend = device - cached
    if cached.min() < 0 or extend.min() < 1 or device.max() > row_width:
        bad = int(np.flatnonzero((cached < 0) | (extend < 1) | (device > row_width))[0])
        raise InvalidArgumentError(
            f"every request needs 0 <= cached_len < device_len <= row width {row_width}; request {bad} "
            f"has cached_len={cached[bad]}, device_len={device[bad]}"
        )
    if phase is ForwardPhase.DECODE and extend.max() != 1:
        bad = int(np.flatnonzero(extend != 1)[0])
        raise InvalidArgumentError(
            f"a decode batch computes exactly one token per request (device_len == cached_len + 1); "
            f"request {bad} has cached_len={cached[bad]}, device_len={device[bad]}"
        )
    return extend
