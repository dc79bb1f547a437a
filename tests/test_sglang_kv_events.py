"""KV cache events through SGLang: the kvplug-backed tree cache publishes, step for step, the
events SGLang's own ``RadixCache`` publishes for the same serving operations (same block hashes,
parent links, token ids, block sizes, media), in SGLang's own event classes and recorder.

Runs in the SGLang test environment (``scripts/test-sglang-host.sh``); skipped elsewhere.
"""

from __future__ import annotations

import functools

import pytest

from tests.sglang_helpers import import_sglang

import_sglang()

from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from tests.sglang_helpers import EVICT_ALL, apply, make_world, page_tokens  # noqa: E402
from tests.test_sglang_host import random_operations  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def sglang_with_plugins():
    """SGLang as a server process sees it: plugins loaded, scheduler-side server args published."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    load_plugins()
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))


def run_with_events(page_size: int, operations, *, kind: str = "radix", **params):
    """Both caches with events on; after every operation both must have queued the same events."""
    reference = make_world("sglang", page_size=page_size, enable_kv_cache_events=True, **params)
    candidate = make_world(kind, page_size=page_size, enable_kv_cache_events=True, **params)
    every_event = []
    for step, operation in enumerate([None, *operations]):
        if operation is not None:
            apply(reference, operation)
            apply(candidate, operation)
        expected, got = reference.cache.take_events(), candidate.cache.take_events()
        assert comparable(got) == comparable(expected), f"step {step}: {operation}"
        every_event += got
    return every_event


def comparable(events):
    """The events, with each ``BlockRemoved``'s hashes as a sorted list: when one eviction takes
    several entries of equal recency, SGLang's heap and kvplug's candidates may take them in
    another order inside the one (coalesced) removal; which blocks go, and every store, must match."""
    return [
        BlockRemoved(block_hashes=sorted(event.block_hashes), medium=event.medium)
        if isinstance(event, BlockRemoved)
        else event
        for event in events
    ]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_random_lifecycles_publish_sglangs_event_stream(seed, page_size):
    events = run_with_events(page_size, list(random_operations(seed, 150, page_size)), size=4096)
    kinds = {type(event) for event in events}
    assert kinds == {AllBlocksCleared, BlockStored, BlockRemoved}  # the comparison covered all three
    stored = [event for event in events if isinstance(event, BlockStored)]
    assert any(event.parent_block_hash is not None for event in stored)  # chains below the root
    assert all(event.block_size == page_size and event.medium == "GPU" for event in stored)


@pytest.mark.parametrize("page_size", [1, 4])
def test_admission_evictions_and_partial_evictions_publish_the_same_removals(page_size):
    tokens = functools.partial(page_tokens, page_size)
    operations = []
    for number in range(9):
        family = number % 3 + 1
        prompt = tokens(family, 10 + family) + [family] + ([number] if number >= 3 else [])
        operations += [("admit", (f"r{number}", prompt, tokens(20 + number))), ("finish", f"r{number}")]
    operations += [("evict", page_size)] * 3 + [("evict", EVICT_ALL)]
    events = run_with_events(page_size, operations, size=12 * page_size)
    assert sum(isinstance(event, BlockRemoved) for event in events) >= 3


def test_reset_publishes_all_blocks_cleared_like_flush_cache():
    operations = [("admit", ("a", [1, 2, 3, 4], [5])), ("finish", "a")]
    reference = make_world("sglang", page_size=1, enable_kv_cache_events=True)
    candidate = make_world("radix", page_size=1, enable_kv_cache_events=True)
    for operation in operations:
        apply(reference, operation)
        apply(candidate, operation)
    reference.cache.reset()
    candidate.cache.reset()
    events = candidate.cache.take_events()
    assert events == reference.cache.take_events() and isinstance(events[-1], AllBlocksCleared)
    candidate.cache.evict(EvictParams(num_tokens=EVICT_ALL))  # nothing left: nothing removed twice
    assert candidate.cache.take_events() == []


def test_events_off_publish_nothing_and_naive_publishes_no_blocks():
    quiet = make_world("radix", page_size=1)
    apply(quiet, ("admit", ("a", [1, 2, 3], [4])))
    apply(quiet, ("finish", "a"))
    assert quiet.cache.take_events() == []
    naive = make_world("naive", page_size=1, enable_kv_cache_events=True)
    apply(naive, ("admit", ("a", [1, 2, 3], [4])))
    apply(naive, ("finish", "a"))
    assert [type(event) for event in naive.cache.take_events()] == [AllBlocksCleared]


def test_a_cache_plugin_without_events_serves_and_warns(caplog):
    from kvplug.interface import PrefixCacheConfig
    from kvplug_sglang.prefix_cache import KvplugPrefixCache
    from tests.version1_cache import Version1Cache as Silent  # a v1 plugin: knows nothing of events
    from tests.sglang_helpers import World, cache_params, make_pools

    table, allocator = make_pools(size=64, page_size=1, max_requests=4, max_context=32)
    params = cache_params(table, allocator, 1, enable_kv_cache_events=True)
    with caplog.at_level("WARNING"):
        cache = KvplugPrefixCache(params, lambda namespace: Silent(PrefixCacheConfig()), "silent")
    assert "publishes no KV cache events" in caplog.text
    world = World(cache, allocator, table, 1)
    apply(world, ("admit", ("a", [1, 2, 3], [4])))
    apply(world, ("finish", "a"))
    assert cache.evictable_size() == 4
    assert [type(event) for event in cache.take_events()] == [AllBlocksCleared]


@pytest.mark.parametrize("dynamo", [False, True])
def test_namespaces_hash_like_sglang(dynamo):
    """LoRA ``extra_key`` and ``cache_salt`` namespaces (one kvplug cache each) publish SGLang's
    namespaced hashes, in SGLang's default and Dynamo formats, for the same inserts and evictions."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    worlds = [make_world(kind, page_size=2, enable_kv_cache_events=True, dynamo_kv_event_format=dynamo) for kind in ("sglang", "radix")]
    from types import SimpleNamespace

    for world in worlds:  # as the scheduler names a LoRA request's namespace for its events
        world.cache.kv_events.lora_names.register(SimpleNamespace(lora_id="a" * 32, extra_key="x" + "a" * 32), "adapter-a")
    namespaces = [(None, None), ("x" + "a" * 32, None), (None, "salt"), ("x" + "a" * 32, "salt")]
    location = 0
    for round_number in range(2):
        for extra_key, salt in namespaces:
            tokens = array_of([1, 2, 3, 4, 5 + round_number, 6])
            values = torch.arange(location, location + 6, dtype=torch.int64)
            location += 6
            for world in worlds:
                world.cache.insert(InsertParams(key=RadixKey(tokens, extra_key, cache_salt=salt), value=values))
    expected, got = (world.cache.take_events() for world in worlds)
    assert comparable(got) == comparable(expected)
    hashes = {h for event in expected if isinstance(event, BlockStored) for h in event.block_hashes}
    assert len(hashes) == 4 * 4  # 3 pages + 1 diverging page per namespace: no two namespaces share a hash
    assert {event.lora_name for event in expected if isinstance(event, BlockStored)} == {None, "adapter-a"}
    for world in worlds:
        world.cache.evict(EvictParams(num_tokens=EVICT_ALL))
    expected, got = (world.cache.take_events() for world in worlds)
    # one SGLang tree holds every namespace; kvplug evicts namespace by namespace (least recently
    # used first): the same blocks go, grouped into removal events differently
    removed = [sorted(h for event in events if isinstance(event, BlockRemoved) for h in event.block_hashes) for events in (expected, got)]
    assert removed[0] == removed[1] and sorted(hashes) == removed[0]


def array_of(values):
    from array import array

    return array("q", values)


@pytest.mark.parametrize("kind", ["sglang", "radix"])
def test_a_kvplug_cache_numbers_from_the_start_time_and_answers_a_new_subscriber(kind, tmp_path):
    """With kvplug's tree cache, a ``"zmq"`` config gets kvplug-sglang's publisher: batches numbered
    from the start time in microseconds, and a subscriber that connects (a router reconnecting to a
    restarted server) is answered at once with an empty batch carrying the number, before any batch
    is published (issue 27); SGLang's own cache keeps SGLang's publisher, numbered from 0, silent."""
    import json
    import time
    from types import SimpleNamespace

    import msgspec
    import zmq
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory, KVEventBatch, ZmqEventPublisher

    from kvplug_sglang.answering_publisher import AnsweringZmqEventPublisher
    from kvplug_sglang.hooks import around_init_kv_events

    endpoint = f"ipc://{tmp_path}/events"
    config = json.dumps({"publisher": "zmq", "endpoint": endpoint, "replay_endpoint": f"ipc://{tmp_path}/replay"})
    world = make_world(kind, page_size=1, enable_kv_cache_events=True)
    started = time.time_ns() // 1000
    publisher = around_init_kv_events(
        lambda owner, cfg: EventPublisherFactory.create(cfg, 0), SimpleNamespace(tree_cache=world.cache), config
    )
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    try:
        assert type(publisher) is (ZmqEventPublisher if kind == "sglang" else AnsweringZmqEventPublisher)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.connect(endpoint)
        answered = subscriber.poll(3_000)
        numbers = []
        if answered:
            topic, number, payload = subscriber.recv_multipart()
            numbers.append(int.from_bytes(number, "big"))
            assert msgspec.msgpack.decode(payload, type=KVEventBatch).events == []
        for _ in range(2):
            publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
            assert subscriber.poll(10_000), "no batch published"
            numbers.append(int.from_bytes(subscriber.recv_multipart()[1], "big"))
    finally:
        subscriber.close()
        publisher.shutdown()
    if kind == "sglang":
        assert not answered and numbers == [0, 1]
    else:
        assert answered and started <= numbers[0] <= time.time_ns() // 1000
        assert numbers[1:] == [numbers[0] + 1, numbers[0] + 2]
