"""Paged prefill / extend attention in Triton, reading the token-granular page table directly.

One program per (request, query head, block of ``BLOCK_M`` new tokens). The new tokens' K/V are
already in the pool (the backend stores before it attends), so a request's whole context --
cached prefix and new tokens alike -- is read the same way, through ``page_table[row, j]``. Query
``t`` of a request sits at position ``cached_len + t`` and sees keys ``j <= cached_len + t``
(causal within the new tokens, full over the prefix); key blocks past the block's last query are
never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplug.kernels.launch import FastLauncher

LOG2_E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    table_ptr,
    rows_ptr,
    cached_ptr,
    lens_ptr,
    start_ptr,
    q_stride_token,
    q_stride_head,
    out_stride_token,
    out_stride_head,
    table_stride,
    kv_stride_location,
    kv_stride_head,
    scale_log2,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    cached = tl.load(cached_ptr + request)
    total = tl.load(lens_ptr + request)
    first_token = tl.load(start_ptr + request)
    extend_len = total - cached
    if block_m * BLOCK_M >= extend_len:
        return
    kv_head = head // GROUP
    row = tl.load(rows_ptr + request).to(tl.int64)

    offsets_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    query_mask = offsets_m < extend_len
    dims = tl.arange(0, DIM_P2)
    dim_mask = dims < DIM
    token_index = (first_token + offsets_m).to(tl.int64)
    q = tl.load(
        q_ptr + token_index[:, None] * q_stride_token + head * q_stride_head + dims[None, :],
        mask=query_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    query_pos = cached + offsets_m

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P2], dtype=tl.float32)
    table_row = table_ptr + row * table_stride
    kv_end = tl.minimum(total, cached + (block_m + 1) * BLOCK_M)
    for block_start in range(0, kv_end, BLOCK_N):
        offsets_n = block_start + tl.arange(0, BLOCK_N)
        key_mask = offsets_n < kv_end
        locations = tl.load(table_row + offsets_n, mask=key_mask, other=0).to(tl.int64)
        kv_offsets = locations[:, None] * kv_stride_location + kv_head * kv_stride_head + dims[None, :]
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        keys = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(keys))
        visible = key_mask[None, :] & (offsets_n[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
        # key 0 is visible to every query, so after the first block every running max is finite
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        correction = tl.math.exp2(running_max - new_max)
        probs = tl.math.exp2(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, 1)
        values = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * correction[:, None] + tl.dot(probs, values.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * correction[:, None] + tl.dot(probs.to(values.dtype), values)
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + token_index[:, None] * out_stride_token + head * out_stride_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=query_mask[:, None] & dim_mask[None, :],
    )


_launch_extend = FastLauncher(_extend_kernel)


def extend_attention(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    table_rows: torch.Tensor,
    cached_lens: torch.Tensor,
    device_lens: torch.Tensor,
    extend_start: torch.Tensor,
    max_extend_len: int,
    scale: float,
    *,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Causal attention of every new token over its request's pooled context.

    Args:
        q: shape ``[num_tokens, num_qo_heads, head_dim]``, unit stride in ``head_dim``, cuda.
        k_flat, v_flat: shape ``[num_locations, num_kv_heads, head_dim]``, contiguous, q's dtype;
            already holding the new tokens' K/V.
        out: shape ``[num_tokens, num_qo_heads, head_dim]``, q's dtype; written.
        page_table: shape ``[rows, row_width]``, int32.
        table_rows, cached_lens, device_lens: shape ``[bs]``, int32.
        extend_start: shape ``[bs + 1]``, int32; where each request's tokens start in ``q``.
        max_extend_len: the largest ``device_len - cached_len`` (host int), sizes the grid.
        scale: softmax scale.
    """
    num_qo_heads, dim = q.shape[1], q.shape[2]
    group = num_qo_heads // k_flat.shape[1]
    bs = table_rows.shape[0]
    if q.dtype == torch.float32:
        block_m, block_n = min(block_m, 32), min(block_n, 32)  # fp32 tiles take twice the shared memory
    grid = (bs, num_qo_heads, triton.cdiv(max_extend_len, block_m))
    _launch_extend(
        grid,
        q,
        k_flat,
        v_flat,
        out,
        page_table,
        table_rows,
        cached_lens,
        device_lens,
        extend_start,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        k_flat.stride(0),
        k_flat.stride(1),
        scale * LOG2_E,
        GROUP=group,
        DIM=dim,
        DIM_P2=triton.next_power_of_2(dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
