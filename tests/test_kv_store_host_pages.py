"""Host-tier pages through a shared store (issue 30): K/V one server's pool holds reach another
server's pool bit-identical, through each one's ``HostKVPool`` and a real ``redis-server``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvplug
from kvplug.kv_store import RemoteKV
from kvplug.kv_store.host_pages import fill_host_pages, host_page_payloads, namespace_for_pool
from kvplug.kv_store.memory_store import InMemoryKVStore
from kvplug.memory.host_pool import HostKVPool
from tests.redis_server import REDIS_SERVER, SKIP_REASON, redis_server

PAGE = 4
PROMPT = list(range(500, 500 + 5 * PAGE))


def pool(seed: int, dtype=torch.bfloat16, heads: int = 2, page_size: int = PAGE):
    config = kvplug.KVPoolConfig(num_layers=3, num_kv_heads=heads, head_dim=8, num_pages=12, page_size=page_size, dtype=dtype)
    kv_pool = kvplug.create_kv_pool("mha", config)
    generator = torch.Generator().manual_seed(seed)
    kv_pool.kv_buffer.copy_(torch.randn(kv_pool.kv_buffer.shape, generator=generator).to(dtype))
    return kv_pool


def locations(pages):
    return np.concatenate([np.arange(page * PAGE, (page + 1) * PAGE) for page in pages]).astype(np.int64)


def tokens_kv(kv_pool, token_locations):
    return kv_pool.kv_buffer.view(2, 3, -1, *kv_pool.kv_buffer.shape[4:])[:, :, torch.as_tensor(token_locations)]


def cross_server(store_a, store_b, dtype=torch.bfloat16):
    """Server A computes five pages and writes them through its host tier; server B loads them."""
    pool_a, pool_b = pool(1, dtype), pool(2, dtype)
    host_a, host_b = HostKVPool(pool_a.kv_buffer, 8), HostKVPool(pool_b.kv_buffer, 8)
    device_a, device_b = [3, 7, 1, 9, 4], [10, 2, 5, 0, 8]
    remote_a = RemoteKV(store_a, namespace_for_pool("tiny", pool_a.kv_buffer))
    remote_b = RemoteKV(store_b, namespace_for_pool("tiny", pool_b.kv_buffer))
    pages_a = host_a.take(5)
    host_a.write(locations(device_a), pages_a)
    assert remote_a.store_pages(PROMPT, host_page_payloads(host_a, pages_a)) == 5
    assert remote_b.lookup(PROMPT) == 5
    pages_b = host_b.take(5)
    assert fill_host_pages(host_b, pages_b, remote_b.load(PROMPT, 0, 5)) == 5
    assert not torch.equal(tokens_kv(pool_a, locations(device_a)), tokens_kv(pool_b, locations(device_b)))
    host_b.read(pages_b, locations(device_b))
    return pool_a, pool_b, device_a, device_b


@pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pages_reach_another_pool_bit_identical_through_redis(dtype):
    with redis_server() as (port, _):
        manager = kvplug.PluginManager(entry_points=False)
        url = f"redis://127.0.0.1:{port}/0"
        pool_a, pool_b, device_a, device_b = cross_server(manager.create_kv_store(url), manager.create_kv_store(url), dtype)
    a, b = tokens_kv(pool_a, locations(device_a)), tokens_kv(pool_b, locations(device_b))
    assert torch.equal(a.view(torch.uint8) if dtype == torch.bfloat16 else a, b.view(torch.uint8) if dtype == torch.bfloat16 else b)


def test_pages_round_trip_through_the_memory_store():
    registry: dict = {}
    stores = [InMemoryKVStore(kvplug.KVStoreConfig("memory://fleet", {"registry": registry})) for _ in range(2)]
    pool_a, pool_b, device_a, device_b = cross_server(*stores)
    assert torch.equal(tokens_kv(pool_a, locations(device_a)), tokens_kv(pool_b, locations(device_b)))


@pytest.mark.parametrize("change", [{"dtype": torch.float16}, {"heads": 4}, {"page_size": 8}])
def test_another_pool_shape_is_another_namespace(change):
    base = namespace_for_pool("tiny", pool(1).kv_buffer)
    assert namespace_for_pool("tiny", pool(1, **change).kv_buffer).prefix != base.prefix
    assert namespace_for_pool("tiny", pool(1).kv_buffer, tp_rank=1, tp_size=2).prefix != base.prefix


def test_a_payload_of_the_wrong_size_is_not_filled():
    host = HostKVPool(pool(1).kv_buffer, 4)
    before = host.buffer.clone()
    good = bytes(host.bytes_per_page)
    assert fill_host_pages(host, [0, 1, 2], [good, good[:-2], good]) == 1
    assert torch.equal(host.buffer[1:].view(torch.uint8), before[1:].view(torch.uint8))
    with pytest.raises(kvplug.InvalidArgumentError, match="outside"):
        fill_host_pages(host, [9], [good])
