"""Issue 32: a third-party prefix cache with a host tier is checked like any untrusted cache.

Each fault of ``tests.faulty_tiered_cache`` (the tier's own methods, and the version-1 ones) is
injected into a backend driven through its public lifecycle with host-tier hits; afterwards every
invariant holds, no page leaks, the cache was replaced and the backend keeps serving. Also: the
checked wrapper changes nothing for a cache that behaves (a differential run against the unwrapped
tiered radix cache, and the tiered conformance kit), and the checks on kvplug's own side of a load.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvplug
from kvplug.backend import ModelShape, create_backend
from kvplug.interface import InvalidArgumentError, PrefixCacheConfig
from kvplug.prefix_cache.checked_tiered import CheckedTieredPrefixCache, HostHandle
from kvplug.prefix_cache.tiered_radix import TieredRadixPrefixCache
from kvplug.testing import check_tiered_prefix_cache
from tests.faulty_cache import FaultyCachePlugin, all_faults
from tests.faulty_tiered_cache import FaultyTieredCache, FaultyTieredCachePlugin, all_tiered_faults
from tests.test_cache_faults import _all_pages_come_back, _serve

SHAPE = ModelShape(num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
HOST = "8KiB"  # 128 pages of 4 tokens of this shape: far more than the device pool


@pytest.fixture(scope="module")
def manager():
    manager = kvplug.PluginManager(entry_points=False)
    manager.register(FaultyCachePlugin(), "faulty-cache-tests")
    manager.register(FaultyTieredCachePlugin(), "faulty-tiered-cache-tests")
    return manager


def _backend(manager, fault: str, page_size: int = 4, num_pages: int = 24, after: int = 2, **options):
    return create_backend(SHAPE, page_size=page_size, num_pages=num_pages, max_running_reqs=4, max_seq_len=64,
                          prefix_cache="faulty-tiered", attention=None, manager=manager,
                          prefix_cache_options={"fault": fault, "after": after, "host_memory": HOST}, **options)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("fault", [f for f in all_tiered_faults() if not f.startswith("host_size_info")]  # asked by no host
                         + [f for f in all_faults() if not f.startswith(("match", "size_info"))])  # matches: match_tiered
def test_each_tiered_fault_replaces_the_cache_and_the_backend_keeps_serving(manager, fault, page_size):
    if page_size == 1 and "unaligned" in fault:
        pytest.skip("every length and location is page-aligned with pages of one token")
    backend = _backend(manager, fault, page_size=page_size, num_pages=96 // page_size)
    faulty = backend.prefix_cache.inner
    assert isinstance(backend.prefix_cache, CheckedTieredPrefixCache) and isinstance(faulty, FaultyTieredCache)
    assert backend.allocator.tiered
    rng = np.random.default_rng(7)
    finished = _serve(backend, rng, 40, prefixes=8)  # more prefixes than the pool holds: host hits
    assert faulty.faults > 0, f"the workload never reached the fault {fault}"
    assert faulty.inner.tier_stats().loads > 0 or faulty.method != "start_host_load"
    health = backend.stats().prefix_cache
    assert health["cache_failures"] >= 1 and health["prefix_cache"] == "naive" and not health["stopped"]
    assert "'faulty-tiered'" in health["last_cache_fault"]
    assert backend.prefix_cache is not faulty and not backend.allocator.tiered
    assert finished + backend.stats().running_requests >= 34
    _all_pages_come_back(backend)
    assert _serve(backend, rng, 6, prefixes=8) == 6
    _all_pages_come_back(backend)


def test_a_tiered_replacement_is_attached_to_the_pool_at_the_hand_over(manager):
    from kvplug.cache_guard import checked, hand_over

    backend = _backend(manager, "none")
    fresh = manager.create_prefix_cache("faulty-tiered", device="cpu", page_size=4,
                                        fault="none", host_memory=HOST)
    replacement = checked(fresh, "faulty-tiered", backend.num_pages, 4)
    assert isinstance(replacement, CheckedTieredPrefixCache) and replacement.host_pool is None
    hand_over(backend, replacement)
    assert backend.prefix_cache is replacement and backend.allocator.tiered and replacement.host_pool is not None
    rng = np.random.default_rng(1)
    assert _serve(backend, rng, 20, prefixes=8) == 20 and backend.allocator.host_hit_tokens > 0
    _all_pages_come_back(backend)


def _workload(seed: int, requests: int = 30):
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 300, 12).tolist() for _ in range(4)]
    return [prefixes[n % 4] + rng.integers(0, 300, int(rng.integers(1, 9))).tolist() for n in range(requests)]


def _replay(backend, prompts) -> list[tuple[int, int]]:
    """Admit, allocate and finish each prompt in turn; (matched_len, host hits so far) per prompt."""
    seen = []
    for prompt in prompts:
        request = backend.admit(prompt)
        backend.allocate([request])
        backend.finish(request, computed=True)
        backend.check_integrity()
        seen.append((request.matched_len, backend.allocator.host_hit_tokens))
    return seen


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_checked_tiered_wrapper_agrees_with_the_tiered_radix_cache(manager, page_size):
    prompts = _workload(page_size)
    common = dict(page_size=page_size, num_pages=48 // page_size, max_running_reqs=2, max_seq_len=64, attention=None)
    plain = create_backend(SHAPE, prefix_cache="radix", prefix_cache_options={"host_memory": HOST}, **common)
    checked = create_backend(SHAPE, prefix_cache="faulty-tiered", manager=manager,
                             prefix_cache_options={"fault": "none", "host_memory": HOST}, **common)
    assert isinstance(checked.prefix_cache, CheckedTieredPrefixCache)
    assert not isinstance(plain.prefix_cache, CheckedTieredPrefixCache)
    expected, got = _replay(plain, prompts), _replay(checked, prompts)
    assert got == expected and expected[-1][1] > 0  # the same matches, host hits included


def test_the_tiered_conformance_kit_passes_through_the_wrapper():
    def factory(config: PrefixCacheConfig):
        return CheckedTieredPrefixCache(TieredRadixPrefixCache(config), num_pages=1 << 16, page_size=config.page_size)

    # page 1 only: the kit inserts arbitrary locations, the wrapper (driven by kvplug) whole pages
    check_tiered_prefix_cache(factory, page_sizes=[1], seeds=2)


def _host_match(page_size: int = 2):
    """A checked tiered cache holding a 4-page prefix in host memory, matched: (cache, match)."""
    from kvplug.memory.mha_pool import MHAKVPool
    from kvplug.interface import KVPoolConfig

    config = PrefixCacheConfig(device=torch.device("cpu"), page_size=page_size, options={"host_memory": "4KiB"})
    cache = CheckedTieredPrefixCache(TieredRadixPrefixCache(config), num_pages=16, page_size=page_size)
    cache.attach_kv_pool(MHAKVPool(KVPoolConfig(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=16,
                                                page_size=page_size, dtype=torch.float32, device=torch.device("cpu"))))
    ids = torch.arange(1, 9, dtype=torch.int32)
    inserted = cache.insert_prefix(ids, torch.arange(0, 8, dtype=torch.int32))
    assert inserted.cached_len == 0
    cache.evict(8)  # all four pages to host memory
    match = cache.match_tiered(ids)
    assert match.handle.cached_len == 0 and match.host_len == 8
    return cache, match


def test_kvplugs_side_of_a_load_is_checked_before_the_plugin_sees_it():
    cache, match = _host_match()
    handle = match.host_handle
    assert isinstance(handle, HostHandle) and not handle.loaded
    with pytest.raises(InvalidArgumentError, match="in host memory"):
        handle.get_matched_indices()
    targets = torch.arange(8, 16, dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="lock the host handle"):
        cache.load_host_prefix(handle, targets)
    cache.lock_handle(handle)
    for bad, message in ((targets[:6], "8 locations"), (targets.long(), "int32"), (targets + 1, "device_indices"),
                         (torch.arange(40, 48, dtype=torch.int32), "outside the pool")):
        with pytest.raises(InvalidArgumentError, match=message):
            cache.load_host_prefix(handle, bad)
    loaded = cache.load_host_prefix(handle, targets)
    assert loaded is handle and handle.loaded and torch.equal(handle.get_matched_indices(), targets)
    assert cache.size_info.protected_size == 8  # the loaded pages, locked as the handle is
    cache.lock_handle(handle, unlock=True)
    assert cache.size_info.evictable_size == 8 and cache.tracked_size_info.evictable_size == 8
    cache.check_integrity()
    with pytest.raises(InvalidArgumentError, match="not loaded yet"):
        cache.load_host_prefix(handle, targets)


def test_bad_tier_sizes_and_stats_are_faults():
    from kvplug.interface import PrefixCacheFault

    for fault, method in (("host_size_info:negative", "host_size_info"), ("tier_stats:raise", "tier_stats")):
        config = PrefixCacheConfig(device=torch.device("cpu"), page_size=2,
                                   options={"fault": fault, "host_memory": "4KiB"})
        cache = CheckedTieredPrefixCache(FaultyTieredCache(config), num_pages=16, page_size=2, name="faulty-tiered")
        with pytest.raises(PrefixCacheFault, match=rf"'faulty-tiered': {method} (returned negative|raised)"):
            cache.host_size_info if method == "host_size_info" else cache.tier_stats()  # noqa: B018


def test_stats_of_an_untrusted_tiered_cache_come_from_the_serving_thread(manager):
    backend = _backend(manager, "none")
    _serve(backend, np.random.default_rng(5), 20, prefixes=8)
    plugin = backend.prefix_cache.inner
    asked = plugin.calls.get("tier_stats", 0)
    tier = backend.stats().tier
    assert plugin.calls.get("tier_stats", 0) == asked  # stats() asked the plugin nothing
    assert tier == plugin.inner.tier_stats().as_dict() and tier["loads"] > 0
