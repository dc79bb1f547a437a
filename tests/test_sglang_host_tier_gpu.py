"""kvplug's host-memory tier under SGLang's tree cache on CUDA: a CPU-resident cache over a CUDA KV
pool, pinned host pages, and the fence on SGLang's forward stream.

The adapter (``KvplugPrefixCache`` built by the ``--kvplug-host-memory`` factory) over kvplug's KV
pool in SGLang's ``KvplugMHATokenToKVPool`` and SGLang's own token allocator, both on the GPU,
with a model runner whose ``forward_stream`` is a real CUDA stream. The streams are used as
SGLang 0.5.23's overlap scheduler uses them: the scheduler's work on the current stream, each
forward on ``forward_stream`` after ``forward_stream.wait_stream(current)``.

- Evicted prefixes are written back to pinned host memory and loaded back through
  ``init_load_back`` bit-identical.
- The fence: while a "forward" still runs on ``forward_stream`` and writes the locations the
  allocator has reclaimed (what SGLang's HiCache fences against), the load must land after it.
  The same scenario with the fence removed loses the loaded bytes, which shows the check can fail.

Skipped without CUDA. On the GPU machine it runs in ``scripts/device-sglang-graphs.sh``'s
environment: SGLang from its wheels (``.whl-sglang/``, ``pip install --no-deps --target
/tmp/sgsite``) and ``PYTHONPATH=tests/sglang_gpu_support:/tmp/sgsite:.:adapters/sglang``.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from tests.attention_reference import requires_cuda
from tests.sglang_helpers import build_context, cache_params, import_sglang

pytestmark = [pytest.mark.gpu, requires_cuda]

import_sglang()

from kvplug_sglang.pools import KvplugMHATokenToKVPool  # noqa: E402
from kvplug_sglang.radix_backends import build_prefix_cache  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

LAYERS, HEADS, DIM = 2, 2, 64
SLEEP_CYCLES = 200_000_000  # about 0.1 s of GPU time: the "forward" still runs when the load is queued


def gpu_world(page_size: int, forward_stream: torch.cuda.Stream):
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    size = 64 * page_size
    kv = KvplugMHATokenToKVPool(
        size=size, page_size=page_size, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
        device="cuda", enable_memory_saver=False,
    )
    table = ReqToTokenPool(size=2, max_context_len=64, device="cuda", enable_memory_saver=False)
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(size, torch.bfloat16, "cuda", kv, need_sort=True)
    else:
        allocator = PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cuda", kv, need_sort=True)
    runner = SimpleNamespace(model_runner=SimpleNamespace(forward_stream=forward_stream))
    context = dataclasses.replace(build_context(cache_params(table, allocator, page_size)), tp_worker=runner)
    cache = build_prefix_cache(context, name="radix", host_memory=64 << 20)
    return cache, allocator, kv.kvplug_pool.kv_buffer.view(2, LAYERS, -1, HEADS, DIM)


def cache_a_prefix(cache, allocator, tokens, length: int) -> tuple[list[int], torch.Tensor]:
    """Write random K/V for a ``length``-token prompt at allocator locations and cache it (unlocked);
    returns the token ids and the K/V ``[2, L, length, H, D]``."""
    ids = list(range(1, length + 1))
    locations = allocator.alloc(length)
    kv = torch.randn(2, LAYERS, length, HEADS, DIM, device="cuda").to(torch.bfloat16)
    tokens[:, :, locations] = kv
    cache.insert(InsertParams(key=RadixKey(ids), value=locations))
    return ids, kv


def load(cache, ids: list[int]) -> tuple[int, object, float]:
    """SGLang's admission path for a prompt extending ``ids``: match, lock the device head,
    ``init_load_back``; returns (loaded tokens, node, CPU seconds ``init_load_back`` took)."""
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(ids + [0])))
    req = SimpleNamespace(last_node=match.last_device_node)
    lock = cache.lock(match.last_device_node)
    started = time.perf_counter()
    loaded, node = cache.init_load_back(
        InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req)
    )
    seconds = time.perf_counter() - started
    cache.unlock(lock)
    return loaded, node, seconds


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_cpu_cache_writes_back_and_loads_a_cuda_pool_bit_identical(page_size):
    forward = torch.cuda.Stream()
    cache, allocator, tokens = gpu_world(page_size, forward)
    tier = cache.root_node.space.cache
    assert tier.device.type == "cpu" and tier.host_pool.pinned and cache._fence_stream is forward
    ids, kv = cache_a_prefix(cache, allocator, tokens, 4 * page_size)
    assert cache.evict(EvictParams(num_tokens=1 << 30)).num_tokens_evicted == len(ids)
    assert allocator.available_size() == allocator.size
    tokens.zero_()
    loaded, node, _ = load(cache, ids)
    assert loaded == len(ids) == node.cached_len
    torch.cuda.synchronize()
    assert torch.equal(tokens[:, :, cache.path_device_indices(node)], kv)
    stats = cache.tier_stats()
    assert (stats.write_backs, stats.loads, stats.loaded_tokens) == (1, 1, len(ids))


@pytest.mark.parametrize("fenced", [True, False])
def test_a_load_lands_after_the_forward_still_writing_reclaimed_locations(fenced, record_property):
    forward = torch.cuda.Stream()
    cache, allocator, tokens = gpu_world(16, forward)
    ids, kv = cache_a_prefix(cache, allocator, tokens, 64)
    cache.evict(EvictParams(num_tokens=1 << 30))
    # the running batch, launched as SGLang launches it, still writes every reclaimed location
    forward.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(forward):
        torch.cuda._sleep(SLEEP_CYCLES)
        tokens.fill_(7.0)
    if not fenced:
        cache._fence_stream = None
    loaded, node, seconds = load(cache, ids)
    record_property("init_load_back_seconds", seconds)
    # the next forward, which reads the loaded prefix
    forward.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(forward):
        read = tokens[:, :, cache.path_device_indices(node).to("cuda")].clone()
    torch.cuda.synchronize()
    assert loaded == len(ids)
    if fenced:
        assert torch.equal(read, kv)
    else:  # the control: without the fence the running batch overwrites the load
        assert not torch.equal(read, kv)
