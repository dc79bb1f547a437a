"""The Triton store kernel equals indexed assignment, bit for bit. Skipped without CUDA/Triton."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import kvplug
from tests.attention_reference import requires_cuda
from kvplug.interface import InvalidArgumentError, KVPoolConfig

pytestmark = [
    pytest.mark.gpu,
    requires_cuda,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (pip install -e \".[triton]\")"),
]


def _reference_store(k_cache, v_cache, out_loc, k, v):
    k_cache[out_loc.long()] = k.reshape(k.shape[0], *k_cache.shape[1:])
    v_cache[out_loc.long()] = v.reshape(v.shape[0], *v_cache.shape[1:])


@pytest.mark.parametrize("num_tokens", [1, 2, 31, 32, 33, 1000, 4097, 16384, 32768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_equals_indexed_assignment(num_tokens, dtype):
    from kvplug.kernels.store_kv import store_kv_triton

    heads, dim, locations = 8, 128, 40_000
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    k_cache = torch.randn(locations, heads, dim, device="cuda", generator=gen).to(dtype)
    v_cache = torch.randn(locations, heads, dim, device="cuda", generator=gen).to(dtype)
    out_loc = torch.randperm(locations, device="cuda", generator=gen)[:num_tokens].to(torch.int32)
    k = torch.randn(num_tokens, heads, dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(num_tokens, heads * dim, device="cuda", generator=gen).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    _reference_store(expected_k, expected_v, out_loc, k, v)
    store_kv_triton(k_cache, v_cache, out_loc, k, v)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("heads, dim", [(1, 64), (2, 64), (3, 80), (32, 128), (4, 256)])
def test_store_handles_head_shapes_and_strided_inputs(heads, dim):
    """Non-power-of-two dims and k/v that are column slices of one fused qkv projection."""
    from kvplug.kernels.store_kv import store_kv_triton

    n, locations = 777, 5000
    k_cache = torch.randn(locations, heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    out_loc = torch.randperm(locations, device="cuda")[:n].to(torch.int32)
    qkv = torch.randn(n, 3 * heads * dim, device="cuda", dtype=torch.bfloat16)
    k, v = qkv[:, heads * dim : 2 * heads * dim], qkv[:, 2 * heads * dim :]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    _reference_store(expected_k, expected_v, out_loc, k, v)
    store_kv_triton(k_cache, v_cache, out_loc, k.view(n, heads, dim), v)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_store_rejects_bad_arguments():
    from kvplug.kernels.store_kv import store_kv_triton

    k_cache = torch.zeros(10, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match="int32"):
        store_kv_triton(k_cache, k_cache.clone(), torch.zeros(3, device="cuda", dtype=torch.int64), k, k)
    with pytest.raises(InvalidArgumentError, match="must be torch.bfloat16"):
        store_kv_triton(k_cache, k_cache.clone(), torch.zeros(3, device="cuda", dtype=torch.int32), k.half(), k)
    with pytest.raises(InvalidArgumentError, match="shape"):
        store_kv_triton(k_cache, k_cache.clone(), torch.zeros(2, device="cuda", dtype=torch.int32), k, k)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mha_pool_triton_store_equals_torch_store(page_size):
    config = dict(num_layers=3, num_kv_heads=8, head_dim=128, num_pages=4096 // page_size, page_size=page_size,
                  dtype=torch.bfloat16, device=torch.device("cuda"))
    triton_pool = kvplug.create_kv_pool("mha", KVPoolConfig(**config, options={"store_kernel": "triton"}))
    torch_pool = kvplug.create_kv_pool("mha", KVPoolConfig(**config, options={"store_kernel": "torch"}))
    out_loc = torch.randperm(4096 + page_size, device="cuda")[:3000].to(torch.int32)
    k = torch.randn(3000, 8 * 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(3000, 8, 128, device="cuda", dtype=torch.bfloat16)
    for pool in (triton_pool, torch_pool):
        pool.store_kv(k, v, out_loc, 1)
    assert torch.equal(triton_pool.kv_buffer, torch_pool.kv_buffer)
    assert triton_pool.kv_buffer[:, 1].abs().sum() > 0 and triton_pool.kv_buffer[:, 0].abs().sum() == 0


def test_fast_launch_reuses_the_compiled_kernel_and_stays_exact():
    """Launches after the first go through kvplug's direct call (where this Triton is verified):
    same results as indexed assignment, also for a misaligned view (a new specialization)."""
    from kvplug.kernels import store_kv
    from kvplug.kernels.launch import fast_path_available

    locations, heads, dim = 5000, 8, 128
    k_cache = torch.zeros(locations, heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    launcher = store_kv._launch_store_kv
    for step, offset in enumerate((0, 0, 0, 1, 1)):  # offset 1: pointers not 16-byte aligned
        gen = torch.Generator(device="cuda").manual_seed(step)
        out_loc = torch.randperm(locations, device="cuda", generator=gen)[: 300 + offset].to(torch.int32)[offset:]
        k = torch.randn(300 + offset, heads, dim, device="cuda", generator=gen).to(torch.bfloat16)[offset:]
        v = torch.randn(300 + offset, heads, dim, device="cuda", generator=gen).to(torch.bfloat16)[offset:]
        expected_k, expected_v = k_cache.clone(), v_cache.clone()
        _reference_store(expected_k, expected_v, out_loc, k, v)
        store_kv.store_kv_triton(k_cache, v_cache, out_loc, k, v)
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    if fast_path_available():
        assert len(launcher._compiled) >= 2, "aligned and misaligned inputs are distinct specializations"
