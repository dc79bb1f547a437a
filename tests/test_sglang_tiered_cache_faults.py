"""Issue 32 in the SGLang host with a host tier: a third-party tiered prefix cache that raises or
answers outside the contract in its tier methods inside SGLang 0.5.23 is quarantined, and SGLang's
allocator stays whole.

Each fault of ``tests.faulty_tiered_cache`` that SGLang's calls reach (``match_tiered`` in
``match_prefix``; ``start_host_load`` behind ``load_host_prefix``, ``tier_stats`` after a load and
the lock / unlock around it, in ``init_load_back``) is injected into the plugin behind the adapter
(``--radix-cache-backend kvplug:faulty-tiered+host_memory=...``) while SGLang's own request
objects and ``PrefillAdder``'s host-hit path admit requests whose prefixes were written back to
host memory. After every step every page is free, held by the tree or owned by a running
request, exactly once; a load that succeeded is bit-identical; at the
end an eviction of everything gives the allocator back every location; the plugin was quarantined
and later requests are served by ``naive``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.sglang_helpers import EVICT_ALL, finish, import_sglang

import_sglang()

import kvplug  # noqa: E402
from kvplug.prefix_cache.checked_tiered import CheckedTieredPrefixCache  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from tests.faulty_tiered_cache import FaultyTieredCache  # noqa: E402
from tests.test_sglang_host_tier import admit, prompt_of, row_kv, sglang_with_plugins, tier_world  # noqa: E402,F401

#: (fault, after): the fault, and calls of its method that behave first, so that it meets the load
FAULTS = [
    ("match_tiered:raise", 1), ("match_tiered:long_host_len", 1), ("match_tiered:unaligned_host_len", 1),
    ("match_tiered:short_host_handle", 1),
    # (SGLang loads with load_host_prefix, which waits for the copy: a load's ``done`` is never used)
    ("start_host_load:raise", 0), ("start_host_load:lost_locations", 0), ("start_host_load:not_a_load", 0),
    # tier_stats: asked after the attach and by the startup log line, then
    ("tier_stats:raise", 2),  # after the write-back: the evicted pages stay the cache's
    ("tier_stats:raise", 3),  # after the load: the loaded pages are the cache's already
    *[("lock_handle:raise", after) for after in range(4)], *[("unlock:raise", after) for after in range(4)],
]  # fmt: skip


class FaultyTieredPlugin:
    """Registers ``faulty-tiered`` misbehaving as ``fault`` from its ``after``-th call on; ``built``
    lists the instances."""

    def __init__(self, fault: str, after: int) -> None:
        self.fault, self.after = fault, after
        self.built: list[FaultyTieredCache] = []

    @kvplug.hookimpl
    def kvplug_register_prefix_caches(self, register):
        def factory(config):
            options = {"fault": self.fault, "after": self.after, **dict(config.options)}
            self.built.append(FaultyTieredCache(dataclasses.replace(config, options=options)))
            return self.built[-1]

        register("faulty-tiered", factory)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("fault, after", FAULTS)
def test_a_faulty_tier_is_quarantined_and_the_allocator_stays_whole(fault, after, page_size):
    if page_size == 1 and "unaligned" in fault:
        pytest.skip("every length is page-aligned with pages of one token")
    manager = kvplug.PluginManager(entry_points=False)
    plugin = FaultyTieredPlugin(fault, after)
    manager.register(plugin, "faulty-tiered-sglang-tests")
    world = tier_world(page_size, name="faulty-tiered", manager=manager)
    cache = world.cache

    def whole(step: str) -> None:
        """In pages: free + held by the tree + owned by running requests == the pool, none twice."""
        owned: list[int] = []
        for req in world.requests.values():
            row = world.table.req_to_token[req.kv.req_pool_idx, req.kv.cache_protected_len : req.kv.kv_allocated_len]
            owned += sorted({int(location) // page_size for location in row.tolist()})
        assert len(owned) == len(set(owned)), f"{fault} after {after}, {step}: a page owned by two requests"
        pages = (world.accounted() // page_size) + len(owned)
        assert pages == world.total() // page_size, f"{fault} after {after}, {step}: {pages} pages accounted"

    assert isinstance(cache._spaces.get((None, None), touch=False).cache, CheckedTieredPrefixCache)
    prompt = prompt_of(page_size, 4)
    first, _ = admit(world, "a", prompt, [901, 902, 903], seed=1)
    cached_len = (len(prompt) + 3) // page_size * page_size
    before = row_kv(world, first, cached_len)
    finish(world, "a")
    whole("a finished")
    cache.evict(EvictParams(num_tokens=EVICT_ALL))  # all of it to host memory
    whole("written back")
    second, loaded = admit(world, "b", prompt + [901, 902, 903, 904, 905], [7], seed=2)
    whole("b admitted")
    if loaded:  # loaded before the fault: the bytes are the ones written back
        assert torch.equal(row_kv(world, second, loaded), before[:, :, :loaded])
    third, _ = admit(world, "c", prompt_of(page_size, 3, start=500), [8, 9], seed=3)
    whole("c admitted")
    for rid in ("b", "c"):
        finish(world, rid)
        whole(f"{rid} finished")
    again, _ = admit(world, "d", prompt + [901], [4], seed=4)
    finish(world, "d")
    whole("d finished")

    assert plugin.built and plugin.built[0].faults > 0, f"the workload never reached {fault} after {after}"
    assert cache.quarantine.failures >= 1 and "'faulty-tiered'" in cache.quarantine.last_fault
    assert not isinstance(cache._spaces.get((None, None), touch=False).cache, CheckedTieredPrefixCache)
    cache.evict(EvictParams(num_tokens=EVICT_ALL))
    assert world.allocator.available_size() == world.total()
    cache.sanity_check()
