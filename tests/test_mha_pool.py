"""``mha`` KV pool: layout, per-layer views, store_kv against a dense reference, validation,
tensor-parallel head sharing, and (on CUDA) the Triton store path against the torch one."""

from __future__ import annotations

import pytest
import torch

import kvplug
from kvplug.interface import InvalidArgumentError, KVPoolConfig
from kvplug.memory.mha_pool import MHAKVPool
from kvplug.memory.tensor_parallel import local_kv_head_range, local_kv_heads, local_qo_heads

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_pool(**overrides) -> MHAKVPool:
    fields = dict(num_layers=3, num_kv_heads=2, head_dim=4, num_pages=5, page_size=2, dtype=torch.float32)
    fields.update(overrides)
    return MHAKVPool(KVPoolConfig(**fields))


def test_layout_views_and_sizes():
    pool = make_pool()
    assert pool.kv_buffer.shape == (2, 3, 6, 2, 2, 4)  # the + 1 page is the dummy page
    assert pool.k_cache(1).shape == (6, 2, 2, 4)
    assert pool.flat_v_cache(2).shape == (12, 2, 4)
    assert pool.num_locations == 12 and pool.num_tokens == 10 and pool.dummy_location == 10
    assert pool.bytes_per_token == 2 * 3 * 2 * 4 * 4
    assert pool.flat_k_cache(1).data_ptr() == pool.kv_buffer[0, 1].data_ptr()
    assert pool.flat_v_cache(0).data_ptr() == pool.kv_buffer[1, 0].data_ptr()
    assert bool((pool.kv_buffer == 0).all())  # zeros: padded slots never read NaN


def test_qwen3_bytes_per_token():
    pool = make_pool(num_layers=28, num_kv_heads=8, head_dim=128, num_pages=1, dtype=torch.bfloat16)
    assert pool.bytes_per_token == 114_688


def test_created_by_name_through_the_plugin_manager():
    config = KVPoolConfig(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=2)
    assert isinstance(kvplug.create_kv_pool("mha", config), MHAKVPool)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("flat_input", [True, False])
@pytest.mark.parametrize("page_size", [1, 4])
def test_store_kv_matches_a_dense_reference(dtype, flat_input, page_size):
    pool = make_pool(dtype=dtype, page_size=page_size, num_pages=6)
    generator = torch.Generator().manual_seed(page_size)
    reference = {layer: {} for layer in range(3)}
    for step in range(4):
        layer = step % 3
        n = 5
        locations = torch.randperm(pool.num_locations, generator=generator)[:n].to(torch.int32)
        k = torch.randn(n, 2, 4, generator=generator).to(dtype)
        v = torch.randn(n, 2, 4, generator=generator).to(dtype)
        if flat_input:
            pool.store_kv(k.reshape(n, 8), v.reshape(n, 8), locations, layer)
        else:
            pool.store_kv(k, v, locations, layer)
        for i, location in enumerate(locations.tolist()):
            reference[layer][location] = (k[i], v[i])
    for layer in range(3):
        for location in range(pool.num_locations):
            k_expected, v_expected = reference[layer].get(location, (torch.zeros(2, 4, dtype=dtype),) * 2)
            assert torch.equal(pool.flat_k_cache(layer)[location], k_expected)
            assert torch.equal(pool.flat_v_cache(layer)[location], v_expected)
            # the page-shaped view addresses the same token
            page, slot = divmod(location, page_size)
            assert torch.equal(pool.k_cache(layer)[page, slot], k_expected)


def test_store_kv_accepts_non_contiguous_inputs_and_an_empty_batch():
    pool = make_pool()
    wide = torch.randn(3, 16)
    k, v = wide[:, ::2], wide[:, 1::2]  # [3, 8], strided
    pool.store_kv(k, v, torch.tensor([0, 5, 11], dtype=torch.int32), 0)
    assert torch.equal(pool.flat_k_cache(0)[5].reshape(8), k[1])
    assert torch.equal(pool.flat_v_cache(0)[11].reshape(8), v[2])
    pool.store_kv(torch.empty(0, 8), torch.empty(0, 8), torch.empty(0, dtype=torch.int32), 2)


def _bad_store_calls(pool: MHAKVPool):
    k = torch.ones(2, 8)
    loc = torch.tensor([1, 2], dtype=torch.int32)
    return {
        "int64 locations": (k, k, loc.long(), 0),
        "2-D locations": (k, k, loc.view(1, 2), 0),
        "location past the pool": (k, k, torch.tensor([1, 12], dtype=torch.int32), 0),
        "negative location": (k, k, torch.tensor([-1, 2], dtype=torch.int32), 0),
        "wrong dtype": (k.half(), k.half(), loc, 0),
        "wrong device": (k.to("meta"), k.to("meta"), loc, 0),
        "wrong head count": (torch.ones(2, 3, 4), torch.ones(2, 3, 4), loc, 0),
        "wrong token count": (torch.ones(3, 8), torch.ones(3, 8), loc, 0),
        "v shape differs": (k, torch.ones(2, 4), loc, 0),
        "layer past the pool": (k, k, loc, 3),
        "negative layer": (k, k, loc, -1),
        "bool layer": (k, k, loc, True),
        "list locations": (k, k, [1, 2], 0),
    }


@pytest.mark.parametrize("case", sorted(_bad_store_calls(make_pool())))
def test_bad_store_raises_and_leaves_the_pool_unchanged(case):
    pool = make_pool()
    pool.kv_buffer.normal_()
    before = pool.kv_buffer.clone()
    with pytest.raises(InvalidArgumentError):
        pool.store_kv(*_bad_store_calls(pool)[case])
    assert torch.equal(pool.kv_buffer, before)


def test_validate_option_controls_only_the_range_check():
    pool = make_pool(options={"validate": False})
    pool.store_kv(torch.ones(1, 8), torch.ones(1, 8), torch.tensor([11], dtype=torch.int32), 0)  # dummy page
    with pytest.raises(InvalidArgumentError):  # cheap checks still run
        pool.store_kv(torch.ones(1, 8), torch.ones(1, 8), torch.tensor([1]), 0)


def test_bad_options_and_layers_are_rejected():
    with pytest.raises(InvalidArgumentError, match="unknown mha pool options"):
        make_pool(options={"validat": True})
    with pytest.raises(InvalidArgumentError, match="store_kernel"):
        make_pool(options={"store_kernel": "cuda"})
    with pytest.raises(InvalidArgumentError, match="CUDA"):
        make_pool(options={"store_kernel": "triton"})
    with pytest.raises(InvalidArgumentError, match="layer_id"):
        make_pool().k_cache(3)


# ---------------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize(
    "heads,tp,local",
    [(8, 1, 8), (8, 2, 4), (8, 8, 1), (2, 4, 1), (1, 8, 1), (4, 8, 1)],
)
def test_local_kv_heads_split_or_replicate(heads, tp, local):
    assert local_kv_heads(heads, tp) == local
    pool = make_pool(num_kv_heads=heads, tp_size=tp, tp_rank=tp - 1)
    assert pool.local_kv_heads == local and pool.kv_buffer.shape[4] == local


@pytest.mark.parametrize("heads,tp", [(3, 2), (4, 6), (8, 3), (6, 4)])
def test_uneven_head_sharing_is_rejected(heads, tp):
    with pytest.raises(InvalidArgumentError, match="cannot share"):
        local_kv_heads(heads, tp)
    with pytest.raises(InvalidArgumentError):
        make_pool(num_kv_heads=heads, tp_size=tp)


def test_head_ranges_cover_every_head_once_when_split_and_evenly_when_replicated():
    assert [local_kv_head_range(8, 4, rank) for rank in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [local_kv_head_range(2, 8, rank)[0] for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(InvalidArgumentError):
        local_kv_head_range(8, 4, 4)
    assert local_qo_heads(16, 4) == 4
    with pytest.raises(InvalidArgumentError):
        local_qo_heads(16, 3)


# ---------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_store_kernel_matches_the_torch_path(dtype):
    pytest.importorskip("triton")
    shape = dict(num_layers=2, num_kv_heads=8, head_dim=128, num_pages=300, page_size=16, dtype=dtype, device="cuda")
    fast = make_pool(**shape, options={"store_kernel": "triton"})
    slow = make_pool(**shape, options={"store_kernel": "torch"})
    assert fast.device.index is not None  # "cuda" resolved to "cuda:N"
    n = 1000
    locations = torch.randperm(fast.num_locations, device="cuda")[:n].to(torch.int32)
    k = torch.randn(n, 8 * 128, device="cuda", dtype=dtype)
    v = torch.randn(n, 8, 128, device="cuda", dtype=dtype)
    for pool in (fast, slow):
        pool.store_kv(k, v, locations, 1)
    torch.cuda.synchronize()
    assert torch.equal(fast.kv_buffer, slow.kv_buffer)
    with pytest.raises(InvalidArgumentError):
        fast.store_kv(k, v, locations + fast.num_locations, 0)
