"""The Triton store kernel: scatter new K/V rows into the pool at token locations.

It is a pure gather-free copy, so it should run at memory bandwidth: each program moves
``BLOCK_TOKENS`` rows of one head (``head_dim`` contiguous elements, 16-byte vectors) for K and V.
Importing this module needs Triton (``pip install triton``, or ``pip install -e ".[triton]"`` in the repository).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplug.interface import InvalidArgumentError
from kvplug.kernels.launch import FastLauncher

BLOCK_TOKENS = 32


@triton.jit
def _store_kv_kernel(
    k_cache_ptr,
    v_cache_ptr,
    loc_ptr,
    k_ptr,
    v_ptr,
    num_tokens,
    k_stride_token,
    k_stride_head,
    v_stride_token,
    v_stride_head,
    ROW: tl.constexpr,  # heads * head_dim: elements of one cache row
    DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    head = tl.program_id(1)
    dims = tl.arange(0, DIM_P2)
    token_mask = tokens < num_tokens
    mask = token_mask[:, None] & (dims < DIM)[None, :]
    locations = tl.load(loc_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    tokens64 = tokens.to(tl.int64)
    destination = locations[:, None] * ROW + head * DIM + dims[None, :]
    k_source = k_ptr + tokens64[:, None] * k_stride_token + head * k_stride_head + dims[None, :]
    tl.store(k_cache_ptr + destination, tl.load(k_source, mask=mask), mask=mask)
    v_source = v_ptr + tokens64[:, None] * v_stride_token + head * v_stride_head + dims[None, :]
    tl.store(v_cache_ptr + destination, tl.load(v_source, mask=mask), mask=mask)


_launch_store_kv = FastLauncher(_store_kv_kernel)


def store_kv_triton(
    k_cache_flat: torch.Tensor,
    v_cache_flat: torch.Tensor,
    out_loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """``k_cache_flat[out_loc] = k; v_cache_flat[out_loc] = v`` in one kernel launch.

    Args:
        k_cache_flat, v_cache_flat: shape ``[num_locations, H, D]``, contiguous, same dtype, cuda.
        out_loc: shape ``[n]``, int32, cuda; locations in ``[0, num_locations)`` (not checked here:
            the pool validates them when asked to).
        k, v: shape ``[n, H, D]`` (any token and head strides, unit stride in ``D``) or
            ``[n, H * D]``, cache dtype, cuda.
    """
    num_tokens = out_loc.shape[0]
    _, heads, dim = k_cache_flat.shape
    k3 = _as_rows(k, "k", num_tokens, heads, dim, k_cache_flat)
    v3 = _as_rows(v, "v", num_tokens, heads, dim, k_cache_flat)
    for name, cache in (("k_cache_flat", k_cache_flat), ("v_cache_flat", v_cache_flat)):
        if cache.shape != k_cache_flat.shape or not cache.is_contiguous() or cache.dtype != k_cache_flat.dtype:
            raise InvalidArgumentError(
                f"{name} must be contiguous [num_locations, {heads}, {dim}] {k_cache_flat.dtype}, got "
                f"{tuple(cache.shape)} {cache.dtype} contiguous={cache.is_contiguous()}"
            )
    if out_loc.dim() != 1 or out_loc.dtype != torch.int32:
        raise InvalidArgumentError(f"out_loc must be shape [n], int32, got {tuple(out_loc.shape)} {out_loc.dtype}")
    if num_tokens == 0:
        return
    grid = (triton.cdiv(num_tokens, BLOCK_TOKENS), heads)
    _launch_store_kv(
        grid,
        k_cache_flat,
        v_cache_flat,
        out_loc,
        k3,
        v3,
        num_tokens,
        k3.stride(0),
        k3.stride(1),
        v3.stride(0),
        v3.stride(1),
        ROW=heads * dim,
        DIM=dim,
        DIM_P2=triton.next_power_of_2(dim),
        BLOCK_TOKENS=BLOCK_TOKENS,
        num_warps=4,
    )


def _as_rows(x: torch.Tensor, name: str, n: int, heads: int, dim: int, cache: torch.Tensor) -> torch.Tensor:
    if x.dtype != cache.dtype or x.device != cache.device:
        raise InvalidArgumentError(f"{name} must be {cache.dtype} on {cache.device}, got {x.dtype} on {x.device}")
    if x.shape == (n, heads * dim):
        x = x.view(n, heads, dim) if x.stride(-1) == 1 else x.reshape(n, heads, dim)
    if x.shape != (n, heads, dim):
        raise InvalidArgumentError(f"{name} must be shape [{n}, {heads}, {dim}] or [{n}, {heads * dim}], got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()
