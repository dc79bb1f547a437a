"""Split-K paged decode attention in Triton, reading the token-granular page table directly.

Stage 1: one program per (request, KV head, split). It owns the contiguous range of the request's
tokens that falls in its split, gathers their K/V rows through ``page_table[row, j]`` (any page
size: the table holds token locations), and runs an online softmax for the whole GQA group of
query heads at once (the group is padded to 16 rows so ``tl.dot`` can use tensor cores). It
writes the normalised partial output and its log-sum-exp (base 2).
Stage 2: one program per (request, query head) merges the splits' partials.

The number of splits depends only on the batch size (not on lengths), so a captured CUDA graph
stays valid when lengths change; splits that fall past a request's end write an empty partial.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvplug.kernels.launch import FastLauncher

LOG2_E = 1.4426950408889634


@triton.jit
def _decode_partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    rows_ptr,
    lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    out_stride_token,
    out_stride_head,
    q_stride_token,
    q_stride_head,
    table_stride,
    kv_stride_location,
    kv_stride_head,
    num_splits,
    scale_log2,
    NUM_QO_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    DIRECT: tl.constexpr,  # a single split: write the final output, no merge pass
):
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + request).to(tl.int64)
    seq_len = tl.load(lens_ptr + request)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    group_offsets = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + group_offsets
    head_mask = group_offsets < GROUP
    dims = tl.arange(0, DIM_P2)
    dim_mask = dims < DIM
    q = tl.load(
        q_ptr + request * q_stride_token + heads[:, None] * q_stride_head + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    running_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DIM_P2], dtype=tl.float32)
    table_row = table_ptr + row * table_stride
    for block_start in range(start, end, BLOCK_N):
        offsets = block_start + tl.arange(0, BLOCK_N)
        token_mask = offsets < end
        locations = tl.load(table_row + offsets, mask=token_mask, other=0).to(tl.int64)
        kv_offsets = locations[:, None] * kv_stride_location + kv_head * kv_stride_head + dims[None, :]
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        keys = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(keys))
        scores = tl.where(token_mask[None, :], scores * scale_log2, float("-inf"))
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

    # an empty split (start >= end) leaves sum 0: write out 0 and lse -inf so stage 2 ignores it
    safe_sum = tl.where(running_sum > 0.0, running_sum, 1.0)
    out = acc / safe_sum[:, None]
    if DIRECT:
        tl.store(
            out_ptr + request * out_stride_token + heads[:, None] * out_stride_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & dim_mask[None, :],
        )
    else:
        lse = tl.where(running_sum > 0.0, running_max + tl.math.log2(safe_sum), float("-inf"))
        part_index = (request * NUM_QO_HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + part_index[:, None] * DIM_P2 + dims[None, :], out, mask=head_mask[:, None])
        tl.store(part_lse_ptr + part_index, lse, mask=head_mask)


_launch_decode_partial = FastLauncher(_decode_partial_kernel)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    out_stride_token,
    out_stride_head,
    num_splits,
    NUM_QO_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    split_mask = splits < num_splits
    dims = tl.arange(0, DIM_P2)
    base = (request * NUM_QO_HEADS + head) * num_splits
    lse = tl.load(part_lse_ptr + base + splits, mask=split_mask, other=float("-inf"))
    max_lse = tl.max(lse, 0)  # finite: every request has at least one token, so one split is non-empty
    weights = tl.math.exp2(lse - max_lse)
    partials = tl.load(part_out_ptr + (base + splits)[:, None] * DIM_P2 + dims[None, :], mask=split_mask[:, None], other=0.0)
    merged = tl.sum(partials * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + request * out_stride_token + head * out_stride_head + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < DIM,
    )


_launch_decode_merge = FastLauncher(_decode_merge_kernel)


def choose_num_splits(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int = 64) -> int:
    """Splits per request: enough programs to give every SM about eight, a power of two."""
    wanted = math.ceil(8 * num_sms / (batch_size * num_kv_heads))
    return max(1, min(max_splits, triton.next_power_of_2(wanted)))


def decode_attention(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    page_table: torch.Tensor,
    table_rows: torch.Tensor,
    device_lens: torch.Tensor,
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    num_splits: int,
    scale: float,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> None:
    """Decode attention for one new token per request.

    Args:
        q: shape ``[bs, num_qo_heads, head_dim]``, unit stride in ``head_dim``, cuda.
        k_flat, v_flat: shape ``[num_locations, num_kv_heads, head_dim]``, contiguous, q's dtype.
        page_table: shape ``[rows, row_width]``, int32, contiguous in its rows.
        table_rows: shape ``[bs]``, int32; device_lens: shape ``[bs]``, int32, each >= 1.
        out: shape ``[bs, num_qo_heads, head_dim]``, q's dtype; written.
        part_out: at least ``bs * num_qo_heads * num_splits * next_pow2(head_dim)`` float32 scratch.
        part_lse: at least ``bs * num_qo_heads * num_splits`` float32 scratch.
        num_splits: KV splits per request (``choose_num_splits``).
        scale: softmax scale.
        block_n, num_warps: tokens per K/V tile and warps per program; ``None`` picks 128 / 8
            when a tile row is at most 256 bytes (bf16/fp16 up to head_dim 128), else 64 / 4.
    """
    bs, num_qo_heads, dim = q.shape
    num_kv_heads = k_flat.shape[1]
    group = num_qo_heads // num_kv_heads
    dim_p2 = triton.next_power_of_2(dim)
    wide = dim_p2 * q.element_size() <= 256  # 128-token K and V tiles, two stages, fit shared memory
    block_n = block_n or (128 if wide else 64)
    num_warps = num_warps or (8 if block_n >= 128 else 4)
    _launch_decode_partial(
        (bs, num_kv_heads, num_splits),
        q,
        k_flat,
        v_flat,
        page_table,
        table_rows,
        device_lens,
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        q.stride(0),
        q.stride(1),
        page_table.stride(0),
        k_flat.stride(0),
        k_flat.stride(1),
        num_splits,
        scale * LOG2_E,
        NUM_QO_HEADS=num_qo_heads,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        DIM=dim,
        DIM_P2=dim_p2,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
        DIRECT=num_splits == 1,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits == 1:
        return
    _launch_decode_merge(
        (bs, num_qo_heads),
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_splits,
        NUM_QO_HEADS=num_qo_heads,
        DIM=dim,
        DIM_P2=dim_p2,
        SPLITS_P2=max(2, triton.next_power_of_2(num_splits)),
        num_warps=4 if dim_p2 >= 128 else 2,
    )
