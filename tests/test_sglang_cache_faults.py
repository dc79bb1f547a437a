"""Issue 32 in the SGLang host: a prefix-cache plugin that raises or answers outside the contract
inside SGLang 0.5.23 is quarantined; SGLang's allocator stays whole and later requests are served.

Every fault of ``tests.faulty_cache`` (raise, exit, locations outside the pool or twice, lengths
that disagree, short / twice / float evictions, lying sizes), from several call counts on, is
injected into the plugin behind the adapter (``--radix-cache-backend kvplug:faulty``, built by the
factory SGLang's ``create_tree_cache`` calls) while SGLang's own request objects and lifecycle
helpers (``init_next_round_input``, ``alloc_token_slots``, ``checkpoint_kv_cache``,
``release_kv_cache``) drive several running requests that share prefixes. After every step:
SGLang's free pages, the pages the tree cache holds and the pages the running requests own add
up to the pool, no page is free while a running request's row points at it, and no two running
requests own a page; at the end, with every request finished, an eviction of everything gives the
allocator back every page. Also: ``--kvplug-on-cache-failure fail`` stops with one error naming
the plugin and what it did; a node matched before the fault and locked after it; the flag on
SGLang's parser; every namespace quarantined at once, KV-event consumers told, a fault inside a flush.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sglang_helpers import (
    EVICT_ALL,
    World,
    admit,
    build_context,
    cache_params,
    checkpoint,
    finish,
    import_sglang,
    make_pools,
)

SGLANG_VERSION = import_sglang()

import kvplug  # noqa: E402
from kvplug.interface import PrefixCacheFault  # noqa: E402
from kvplug.prefix_cache.checked import CheckedPrefixCache  # noqa: E402
from kvplug_sglang.radix_backends import build_prefix_cache  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args, set_global_server_args_for_scheduler  # noqa: E402
from tests.faulty_cache import FaultyCache, all_faults  # noqa: E402

SIZE = 96  # tokens in SGLang's pool


@pytest.fixture(scope="module", autouse=True)
def sglang_with_plugins():
    load_plugins()
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))


class FaultyPlugin:
    """Registers ``faulty``: ``tests.faulty_cache.FaultyCache`` misbehaving as ``fault`` from its
    ``after``-th call of that method on; ``built`` lists the instances."""

    def __init__(self, fault: str, after: int) -> None:
        self.fault, self.after = fault, after
        self.built: list[FaultyCache] = []

    @kvplug.hookimpl
    def kvplug_register_prefix_caches(self, register):
        def factory(config):
            options = {"fault": self.fault, "after": self.after, **dict(config.options)}
            self.built.append(FaultyCache(dataclasses.replace(config, options=options)))
            return self.built[-1]

        register("faulty", factory)


def faulty_world(fault: str, after: int, *, page_size: int, policy: str = "fallback") -> tuple[World, FaultyPlugin]:
    manager = kvplug.PluginManager(entry_points=False)
    plugin = FaultyPlugin(fault, after)
    manager.register(plugin, "faulty-cache-sglang-tests")
    table, allocator = make_pools(size=SIZE, page_size=page_size, max_requests=6, max_context=64)
    cache = build_prefix_cache(build_context(cache_params(table, allocator, page_size)), name="faulty",
                               manager=lambda: manager, on_cache_failure=policy)
    return World(cache, allocator, table, page_size), plugin


def tree_cache_tokens(world: World) -> int:
    return world.cache.evictable_size() + world.cache.protected_size()


def assert_conserved(world: World, step: str) -> None:
    """In pages: free + cached + owned by running requests == the pool; nothing a running
    request's row points at is free; no page owned twice (a request's own part starts a page)."""
    page = world.page_size
    free = world.allocator.get_all_free_pages().tolist()
    assert len(free) == len(set(free)), f"{step}: a free page listed twice"
    free_set = set(free)
    owned: list[int] = []
    for rid, req in world.requests.items():
        row = world.table.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len].tolist()
        assert not free_set & {location // page for location in row}, f"{step}: request {rid}'s row points at free pages"
        owned += sorted({location // page for location in row[req.kv.cache_protected_len :]})
    assert len(owned) == len(set(owned)), f"{step}: a page owned by two running requests"
    cached, partial = divmod(tree_cache_tokens(world), page)
    assert partial == 0, step
    assert len(free) + cached + len(owned) == SIZE // page, (
        f"{step}: {len(free)} free + {cached} cached + {len(owned)} owned pages != {SIZE // page}"
    )


def serve(world: World, rng: random.Random, requests: int, step: str) -> int:
    """Admit, checkpoint and finish ``requests`` requests over three shared prefixes, at most three
    running at once, evicting now and then; conservation checked after every operation. Returns
    how many prefix tokens were matched."""
    page = world.page_size
    prefixes = [[rng.randrange(1000) for _ in range(2 * page)] for _ in range(3)]
    matched = 0
    for number in range(requests):
        rid = f"{step}-{number}"
        prompt = prefixes[number % 3] + [rng.randrange(1000) for _ in range(rng.randrange(1, 2 * page + 2))]
        output = [rng.randrange(1000) for _ in range(rng.randrange(1, page + 2))]
        req = admit(world, rid, prompt, output)
        matched += req.prefix_len
        assert_conserved(world, f"{step}: admitted {rid}")
        if rng.random() < 0.5:
            checkpoint(world, rid)
            assert_conserved(world, f"{step}: checkpointed {rid}")
        while len(world.requests) > 2:
            finish(world, next(iter(world.requests)))
            assert_conserved(world, f"{step}: finished")
        if rng.random() < 0.3:
            world.cache.evict(EvictParams(num_tokens=rng.randrange(1, 3 * page)))
            assert_conserved(world, f"{step}: evicted")
    return matched


def drain(world: World) -> None:
    """Finish every request and evict everything: the allocator must have every page back."""
    for rid in list(world.requests):
        finish(world, rid)
    world.cache.evict(EvictParams(num_tokens=EVICT_ALL))
    assert tree_cache_tokens(world) == 0
    assert world.free_locations() == list(range(world.page_size, SIZE + world.page_size))


def namespace_cache(world: World):
    return world.cache._spaces.get((None, None), touch=False).cache


# ============================================================================ every fault


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("fault", all_faults())
def test_a_faulty_plugin_is_quarantined_and_sglang_keeps_serving(fault, page_size):
    rng = random.Random(zlib.crc32(f"{fault} {page_size}".encode()))
    for after in (0, 2, 6):
        world, plugin = faulty_world(fault, after, page_size=page_size)
        serve(world, rng, 14, f"{fault} after {after}")
        if world.cache.quarantine.failures == 0:  # this call count was never reached in this run
            if (fault, page_size) != ("insert_prefix:unaligned_cached_len", 1):  # no lie possible at page 1
                assert plugin.built[0].faults == 0, f"{fault} after {after}: a fault went unnoticed"
            drain(world)
            continue
        assert world.cache.quarantine.failures == 1
        # named where it was met (a page-1 "unaligned" match passes the checks and fails at its lock)
        assert world.cache.quarantine.last_fault.startswith("prefix cache 'faulty': ")
        assert not isinstance(namespace_cache(world), CheckedPrefixCache)  # the fallback took over
        calls = dict(plugin.built[0].calls)
        serve(world, rng, 10, f"{fault} after {after}, after the fault")  # later requests are served
        assert plugin.built[0].calls == calls, "the quarantined plugin was called again"
        world.cache.sanity_check()
        drain(world)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fault=st.sampled_from(all_faults()),
    after=st.integers(0, 40),
    page_size=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_random_faults_in_random_lifecycles_keep_the_allocator_whole(fault, after, page_size, seed):
    """Any fault, from any call count on, anywhere in a random lifecycle: conservation after every
    step, every page back at the end."""
    rng = random.Random(seed)
    world, _ = faulty_world(fault, after, page_size=page_size)
    serve(world, rng, 16, f"{fault} after {after}")
    drain(world)


def test_every_fault_is_met_at_least_once():
    """The parametrized test above is not vacuous: each fault trips the quarantine for some call count."""
    rng = random.Random(7)
    for fault in all_faults():
        tripped = False
        for after in (0, 2, 6):
            world, _ = faulty_world(fault, after, page_size=4)
            serve(world, rng, 14, fault)
            tripped |= world.cache.quarantine.failures > 0
        assert tripped, f"{fault} never faulted in the SGLang lifecycle"


# ============================================================================ running requests


def test_a_running_requests_locked_prefix_survives_the_quarantine():
    page = 4
    world, _ = faulty_world("evict:raise", 0, page_size=page)
    prefix = list(range(100, 100 + 3 * page))
    admit(world, "first", prefix + [1, 2], [3])
    finish(world, "first")
    admit(world, "other", list(range(500, 500 + 2 * page)), [3])  # something evictable
    finish(world, "other")
    second = admit(world, "second", prefix + [7, 8, 9], [4, 5])
    assert second.prefix_len == 3 * page
    shared = world.table.req_to_token[second.kv.req_pool_idx, : 3 * page].tolist()
    world.cache.evict(EvictParams(num_tokens=EVICT_ALL))  # the plugin raises: quarantined
    assert world.cache.quarantine.failures == 1
    assert_conserved(world, "after the fault")
    world.cache.evict(EvictParams(num_tokens=EVICT_ALL))  # the fallback evicts all it may
    free = set(world.free_locations())
    assert not free & set(shared), "a running request's locked prefix went back to the allocator"
    assert world.cache.protected_size() >= 3 * page
    checkpoint(world, "second")
    assert_conserved(world, "checkpoint after the fault")
    third = admit(world, "third", prefix + [6], [1])
    assert third.prefix_len == 0  # nothing of the quarantined cache is matched again
    finish(world, "second")
    finish(world, "third")
    assert_conserved(world, "all finished")
    drain(world)


def test_a_node_matched_before_the_fault_is_locked_after_it():
    """SGLang matches every waiting request, then locks the ones it admits: a fault in between."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    page = 4
    world, _ = faulty_world("match_prefix:outside_pool", 3, page_size=page)
    prefix = list(range(100, 100 + 2 * page))
    admit(world, "first", prefix + [1], [2])  # match 1
    finish(world, "first")
    key = RadixKey(array("q", prefix + [5]))
    early = world.cache.match_prefix(MatchPrefixParams(key=key)).last_device_node  # match 2
    assert early.cached_len == 2 * page
    world.cache.match_prefix(MatchPrefixParams(key=key))  # match 3: the root's; match 4 faults
    world.cache.match_prefix(MatchPrefixParams(key=key))
    assert world.cache.quarantine.failures == 1
    lock = world.cache.lock(early)  # the stale node: its pages are still held, now locked
    assert world.cache.protected_size() == 2 * page
    world.cache.evict(EvictParams(num_tokens=EVICT_ALL))
    assert not set(world.free_locations()) & set(world.cache.path_device_indices(early).tolist())
    world.cache.unlock(lock)
    drain(world)


# ============================================================================ policy fail and the flag


def test_policy_fail_stops_with_one_error_naming_the_plugin_and_what_it_did():
    world, _ = faulty_world("insert_prefix:huge_cached_len", 0, page_size=1, policy="fail")
    admit(world, "first", [1, 2, 3], [4])
    with pytest.raises(PrefixCacheFault) as error:
        finish(world, "first")
    message = str(error.value)
    assert "'faulty'" in message and "cache_finished_req" in message and "insert_prefix" in message
    assert "cached_len 1000000" in message and "--kvplug-on-cache-failure fail" in message
    assert error.value.plugin == "faulty" and error.value.method == "insert_prefix"


def test_trusted_caches_are_not_checked():
    table, allocator = make_pools(size=SIZE, page_size=1, max_requests=2, max_context=16)
    cache = build_prefix_cache(build_context(cache_params(table, allocator, 1)), name="radix")
    assert not isinstance(namespace_cache(World(cache, allocator, table, 1)), CheckedPrefixCache)


def parse(*flags: str) -> ServerArgs:
    return prepare_server_args(["--model-path", "dummy", *flags])


def test_the_flag_travels_in_sglangs_radix_cache_backend_field():
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    assert parse("--kv-backend", "kvplug").radix_cache_backend == "kvplug:radix"
    assert parse("--kv-backend", "kvplug", "--kvplug-on-cache-failure", "fallback").radix_cache_backend == "kvplug:radix"
    args = parse("--kv-backend", "kvplug", "--prefix-cache", "naive", "--kvplug-on-cache-failure", "fail")
    assert args.radix_cache_backend == "kvplug:naive+on_cache_failure=fail"
    table, allocator = make_pools(size=16, page_size=1, max_requests=2, max_context=16)
    cache = get_radix_cache_factory(args.radix_cache_backend)(build_context(cache_params(table, allocator, 1)))
    assert cache.quarantine.policy == "fail" and cache.name == "naive"


def test_the_flag_needs_kv_backend_kvplug(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--kvplug-on-cache-failure", "fail")
    assert exit_info.value.code == 2
    assert "--kvplug-on-cache-failure select kvplug components: add --kv-backend kvplug" in capsys.readouterr().err


# ============================================================================ namespaces, events, flush


def test_every_namespace_of_the_plugin_is_quarantined_at_once():
    """A LoRA adapter's namespace (``extra_key``) has its own cache of the plugin: both go."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    world, plugin = faulty_world("evict:twice", 0, page_size=1)
    cache, allocator = world.cache, world.allocator
    for extra_key, tokens in ((None, [1, 2, 3, 4]), ("lora-a", [1, 2, 3, 4, 5])):
        cache.insert(InsertParams(key=RadixKey(array("q", tokens), extra_key), value=allocator.alloc(len(tokens))))
    assert len(plugin.built) == 2 and tree_cache_tokens(world) == 9
    key = RadixKey(array("q", [1, 2, 3, 4, 9]), "lora-a")
    cache.evict(EvictParams(num_tokens=2))  # one namespace's plugin answers a page twice
    assert cache.quarantine.failures == 1
    spaces = list(cache._spaces)
    assert len(spaces) == 2 and not any(isinstance(space.cache, CheckedPrefixCache) for space in spaces)
    assert cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len == 0  # quarantined: nothing matched
    assert len(world.free_locations()) + tree_cache_tokens(world) == SIZE
    cache.root_node_handle("lora-b")  # a new namespace gets the fallback, not the plugin
    assert len(plugin.built) == 2
    drain(world)


def test_kv_event_consumers_are_told_the_plugins_blocks_are_gone():
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared

    table, allocator = make_pools(size=SIZE, page_size=1, max_requests=6, max_context=64)
    manager = kvplug.PluginManager(entry_points=False)
    manager.register(FaultyPlugin("match_prefix:outside_pool", 1), "faulty-cache-sglang-tests")
    params = cache_params(table, allocator, 1, enable_kv_cache_events=True)
    cache = build_prefix_cache(build_context(params), name="faulty", manager=lambda: manager)
    world = World(cache, allocator, table, 1)
    cache.take_events()
    admit(world, "first", [1, 2, 3, 4], [5])
    finish(world, "first")
    admit(world, "second", [1, 2, 3, 4, 6], [7])  # its match faults
    assert cache.quarantine.failures == 1
    events = cache.take_events()
    assert isinstance(events[-1], AllBlocksCleared)
    finish(world, "second")
    admit(world, "third", [8, 9], [1])
    finish(world, "third")
    assert cache.take_events() == []  # naive publishes nothing (and the plugin is not called again)
    drain(world)


def test_a_fault_in_a_flush_quarantines_and_the_flush_completes():
    """SGLang's ``/flush_cache``: ``tree_cache.reset()`` then the allocator's ``clear()``."""
    world, plugin = faulty_world("none", 0, page_size=1)
    rng = random.Random(3)
    serve(world, rng, 6, "before the flush")
    for rid in list(world.requests):
        finish(world, rid)
    assert tree_cache_tokens(world) > 0
    faulty = plugin.built[0]  # from its next size_info on, it lies: the reset's own check meets it
    faulty.method, faulty.fault, faulty.after = "size_info", "wrong_total", faulty.calls.get("size_info", 0)
    world.cache.reset()
    assert world.cache.quarantine.failures == 1 and "size_info after reset" in world.cache.quarantine.last_fault
    world.allocator.clear()
    assert tree_cache_tokens(world) == 0 and len(world.free_locations()) == SIZE
    serve(world, rng, 6, "after the flush")
    drain(world)


def test_a_fault_in_the_size_check_after_an_eviction_loses_no_page():
    """The plugin evicted, then its ``size_info`` fails the wrapper's check: those pages were never
    handed back, so the quarantine must still count them (found by the random test above)."""
    world, plugin = faulty_world("none", 0, page_size=1)
    admit(world, "first", list(range(100, 112)), [1])
    finish(world, "first")
    cached = tree_cache_tokens(world)
    faulty = plugin.built[0]  # the eviction's first size_info (how much is evictable) passes, its check fails
    faulty.method, faulty.fault, faulty.after = "size_info", "wrong_total", faulty.calls.get("size_info", 0) + 1
    result = world.cache.evict(EvictParams(num_tokens=4))
    assert world.cache.quarantine.failures == 1 and "size_info after evict" in world.cache.quarantine.last_fault
    assert len(world.free_locations()) + tree_cache_tokens(world) == SIZE
    assert result.num_tokens_evicted >= 4 and tree_cache_tokens(world) == cached - result.num_tokens_evicted
    drain(world)


def test_server_info_reports_the_quarantine():
    """Issue 32: ``/server_info``'s ``internal_states`` carry the quarantine record (the hook on
    SGLang's ``SchedulerInternalStateController.get_internal_state``), before and after a fault."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import GetInternalStateReqOutput
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvplug_sglang.hooks import after_get_internal_state

    target = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
    assert target in HookRegistry._patched
    world, _ = faulty_world("match_prefix:outside_pool", 0, page_size=1)

    def record() -> dict:
        output = GetInternalStateReqOutput(internal_state={"page_size": 1})
        result = after_get_internal_state(output, SimpleNamespace(scheduler=SimpleNamespace(tree_cache=world.cache)), None)
        assert result.internal_state["page_size"] == 1  # SGLang's own state untouched
        return result.internal_state["kvplug_prefix_cache"]

    assert record() == {"prefix_cache": "faulty", "cache_failures": 0, "last_cache_fault": None,
                        "on_cache_failure": "fallback", "stopped": False, "quarantined_prefix_cache": None}
    admit(world, "first", [1, 2, 3], [4])
    finish(world, "first")
    admit(world, "second", [1, 2, 3, 5], [6])  # its match answers a location outside the pool
    after = record()
    assert after["cache_failures"] == 1 and after["prefix_cache"] == "naive" and not after["stopped"], after
    assert after["quarantined_prefix_cache"] == "faulty" and "outside the pool" in after["last_cache_fault"]
    native = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=object()))  # SGLang's own tree cache
    assert "kvplug_prefix_cache" not in after_get_internal_state(
        GetInternalStateReqOutput(internal_state={}), native, None).internal_state
    drain(world)
