"""The shared KV store's writer (issue 30) on the CPU: writes in submission order after their copy
lands, a full queue drops at once (counted), a failed copy or store is counted and never stored,
pinned host pages are not reused until written, and a property run of serves and evictions
through a writer thread whose store answers late leaves the tree sound and the store exact."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvplug
from kvplug.interface import KVStoreError, TierCopyError
from kvplug.interface.kv_store import BaseKVStore
from kvplug.kv_store import KVNamespace, RemoteKV
from kvplug.memory.host_pool import HostKVPool
from kvplug.prefix_cache.host_pins import HostPagePins
from kvplug.prefix_cache.store_writer import StoreWrite, StoreWriter
from tests.test_kv_store_tier import PAGE, PROMPT, Server

MANAGER = kvplug.PluginManager(entry_points=False)
NAMESPACE = KVNamespace("tiny", "mha:test", PAGE, "float32")
WAIT_S = 10.0  # a bound on waits that should end at once; never reached when the code is right


class GatedStore(BaseKVStore):
    """An in-memory store whose ``put`` waits for ``gate`` and records its keys; ``fail`` raises."""

    concurrent_calls = True

    def __init__(self, registry=None):
        self.inner = MANAGER.create_kv_store("memory://gated", registry=registry if registry is not None else {})
        self.gate = threading.Event()
        self.gate.set()
        self.in_put = threading.Event()
        self.puts: list[list[str]] = []
        self.fail = None

    def exists(self, keys):
        return self.inner.exists(keys)

    def put(self, keys, pages):
        self.in_put.set()
        assert self.gate.wait(WAIT_S), "the test never opened the store's gate"
        if self.fail is not None:
            raise self.fail
        self.puts.append(list(keys))
        return self.inner.put(keys, pages)

    def get(self, keys):
        return self.inner.get(keys)

    def describe(self):
        return "gated-memory"


class LandingPool(HostKVPool):
    """A CPU host pool whose copies "land" (``wait_written``) when the test says, or fail."""

    def __init__(self, num_pages=16):
        super().__init__(torch.zeros(2, 1, 9, PAGE, 1, 2), num_pages)
        self._landed: dict[int, threading.Event] = {}
        self._failed: set[int] = set()
        self._lock = threading.Lock()
        self.waited: list[int] = []  # tickets the writer waited for, in order

    def landed(self, ticket) -> threading.Event:
        with self._lock:
            return self._landed.setdefault(ticket, threading.Event())

    def fail(self, ticket):
        self._failed.add(ticket)
        self.landed(ticket).set()

    def wait_written(self, ticket):
        if ticket is None:
            return
        self.waited.append(ticket)
        assert self.landed(ticket).wait(WAIT_S), f"copy {ticket} never landed"
        if ticket in self._failed:
            raise TierCopyError(f"copy {ticket} failed (test)")


def page_values(pool, pages, value):
    """Fill host pages with ``value + index``: what the store must get back, byte for byte."""
    for index, page in enumerate(pages):
        pool.buffer[int(page)] = float(value + index)


def writer_world(*, max_queued=8):
    store = GatedStore()
    pool = LandingPool()
    remote = RemoteKV(store, NAMESPACE)
    pins = HostPagePins()
    return store, pool, remote, pins, StoreWriter(remote, pool, threaded=True, max_queued=max_queued)


def one_write(pool, pins, number, ticket, pages=2):
    """Write ``number``: ``pages`` pages of its own prompt, host pages taken from ``pool``."""
    host_pages = pool.take(pages)
    page_values(pool, host_pages, 100 * number)
    tokens = np.arange(number * 1000, number * 1000 + pages * PAGE, dtype=np.int32)
    return StoreWrite(tokens, 0, pins.pin(host_pages), ticket), tokens


def stored_values(remote, tokens, pages):
    return [np.frombuffer(bytes(payload), dtype=np.float32)[0] for payload in remote.load(tokens, 0, pages)]


def wait_until(condition):
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "the writer did not get there"
        time.sleep(0.001)


def test_writes_reach_the_store_in_submission_order_after_their_copy_lands():
    store, pool, remote, pins, writer = writer_world()
    writes = [one_write(pool, pins, number, ticket=number) for number in range(1, 6)]
    for write, _ in writes:
        assert writer.submit(write)
    wait_until(lambda: pool.waited == [1])  # the worker waits for the first copy before anything else
    assert store.puts == [], "a write was stored before its copy landed"
    for number in reversed(range(1, 6)):  # copies land last first: the writer still writes in order
        pool.landed(number).set()
    assert writer.flush(WAIT_S)
    assert pool.waited == [1, 2, 3, 4, 5]
    assert store.puts == [list(remote.keys(tokens)) for _, tokens in writes]
    for number, (write, tokens) in enumerate(writes, start=1):
        assert write.pins.released
        assert stored_values(remote, tokens, 2) == [100 * number, 100 * number + 1]
    stats = remote.stats
    assert (stats.queued_pages, stats.written_pages, stats.unwritten_pages, stats.dropped_pages) == (10, 10, 0, 0)


def test_a_full_queue_drops_the_write_at_once_counted_and_releases_its_pages():
    store, pool, remote, pins, writer = writer_world(max_queued=2)
    first, _ = one_write(pool, pins, 1, ticket=1)
    assert writer.submit(first)
    wait_until(lambda: writer.queued == 0)  # the worker took it and waits for its copy
    queued = [one_write(pool, pins, number, ticket=number)[0] for number in (2, 3)]
    assert all(writer.submit(write) for write in queued)
    dropped, dropped_tokens = one_write(pool, pins, 4, ticket=4)
    assert not writer.submit(dropped), "a write past max_queued was queued"  # no copy has landed: it did not wait
    assert dropped.pins.released and not first.pins.released
    assert remote.stats.unwritten_pages == 2 and remote.stats.queued_pages == 8
    for ticket in (1, 2, 3):
        pool.landed(ticket).set()
    assert writer.flush(WAIT_S)
    assert remote.stats.written_pages == 6 and remote.lookup(dropped_tokens) == 0
    pins.reclaim(pool)
    assert pins.pinned_pages == 0


def test_a_failed_copy_or_store_is_counted_and_nothing_is_stored():
    store, pool, remote, pins, writer = writer_world()
    failed_copy, copy_tokens = one_write(pool, pins, 1, ticket=1)
    pool.fail(1)
    assert writer.submit(failed_copy)
    assert writer.flush(WAIT_S)
    assert failed_copy.pins.released and remote.stats.unwritten_pages == 2 and store.puts == []
    store.fail = KVStoreError("down (test)", reason="unavailable")
    failed_store, store_tokens = one_write(pool, pins, 2, ticket=2)
    pool.landed(2).set()
    assert writer.submit(failed_store)
    assert writer.flush(WAIT_S)
    stats = remote.stats
    assert failed_store.pins.released and stats.dropped_pages == 2 and stats.errors_unavailable == 1
    store.fail = None
    assert remote.lookup(copy_tokens) == 0
    remote._down_until = None  # the back-off is RemoteKV's; the store is up again
    assert remote.lookup(store_tokens) == 0


def test_close_waits_a_bounded_time_then_drops_what_is_queued():
    store, pool, remote, pins, writer = writer_world()
    stuck, _ = one_write(pool, pins, 1, ticket=1)
    waiting, _ = one_write(pool, pins, 2, ticket=2)
    assert writer.submit(stuck) and writer.submit(waiting)
    assert not writer.close(timeout_s=0.05)  # copy 1 never lands within the bound
    assert waiting.pins.released and remote.stats.unwritten_pages == 2
    late, _ = one_write(pool, pins, 3, ticket=None)
    assert not writer.submit(late) and late.pins.released
    pool.landed(1).set()  # the write under way still finishes
    wait_until(lambda: stuck.pins.released)
    assert remote.stats.written_pages == 2 and remote.stats.unwritten_pages == 4


def test_pins_park_freed_pages_until_released_and_survive_a_reset():
    pool = LandingPool(num_pages=4)
    pins = HostPagePins()
    pages = pool.take(2)
    pin = pins.pin(pages)
    with pytest.raises(kvplug.InvalidArgumentError, match="pinned already"):
        pins.pin(pages[:1])
    pins.free(pool, pages)  # their node was dropped: parked, not free
    assert pool.num_free_pages == 2 and list(pins.parked_pages) == list(pages)
    pool.reset()
    pins.after_reset(pool)
    assert pool.num_free_pages == 2 and not np.isin(pool.free_pages(), pages).any()
    pins.reclaim(pool)  # not released yet: nothing comes back
    assert pool.num_free_pages == 2
    pin.release()
    pin.release()  # a second release does nothing
    pins.reclaim(pool)
    assert pool.num_free_pages == 4 and pins.pinned_pages == 0 and pins.parked_pages.size == 0


def test_pinned_host_pages_are_not_reused_until_written_and_the_store_gets_their_bytes():
    registry: dict = {}
    store = GatedStore(registry)
    first = Server(store, host_pages=6, options={"remote_kv_writes": "thread"})
    first.serve(PROMPT)
    store.gate.clear()  # the store is slow: the write waits in put
    first.backend.evict_prefix_cache(6 * PAGE)
    assert store.in_put.wait(WAIT_S)
    other = [60 + index % 13 for index in range(6 * PAGE + 1)]
    assert first.serve(other) == 0  # reads go on while the write waits (concurrent_calls)
    first.backend.evict_prefix_cache(6 * PAGE)  # host room only by dropping PROMPT's node: its pages stay pinned
    tier = first.cache.tier_stats()
    assert tier.host_free_pages == 0 and first.cache._host_tier.pins.parked_pages.size == 6
    assert tier.host_evictable_tokens == 0, "the second prefix was given host pages a queued write still reads"
    first.backend.check_integrity()
    store.gate.set()
    assert first.cache.flush_remote_kv(WAIT_S)
    assert first.cache.remote_kv.stats.written_pages == 6
    second = Server(GatedStore(registry))
    assert second.serve(PROMPT) == 6 * PAGE  # K/V checked against the recompute inside serve
    first.serve(other)
    first.backend.evict_prefix_cache(6 * PAGE)  # the pages came back: this one keeps its host copy
    assert first.cache.tier_stats().host_evictable_tokens == 6 * PAGE
    first.backend.check_integrity()
    assert first.cache.flush_remote_kv(WAIT_S) and first.cache.close_remote_kv()


def test_remote_kv_writes_is_validated():
    with pytest.raises(kvplug.InvalidArgumentError, match="remote_kv_writes"):
        Server(GatedStore(), options={"remote_kv_writes": "later"})
    with pytest.raises(kvplug.InvalidArgumentError, match="without remote_kv"):
        kvplug.create_prefix_cache("radix", page_size=PAGE, host_memory=1 << 20, remote_kv_writes="thread")


PROMPTS = [[base + index % (5 + base % 7) for index in range(pages * PAGE + 1)]
           for base, pages in ((3, 6), (40, 3), (70, 5), (90, 2), (120, 4))]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.booleans(), st.booleans()), min_size=1,
                      max_size=12))
def test_any_run_through_a_slow_writer_stays_sound_and_stores_only_exact_pages(steps):
    """Serve prompts, evict, let the store lag (gate closed) or catch up, in any order: the tree
    passes its integrity check at every step, and every page in the store loads as the recompute."""
    registry: dict = {}
    store = GatedStore(registry)
    first = Server(store, host_pages=8, options={"remote_kv_writes": "thread"})
    for prompt_index, evict, store_lags in steps:
        if store_lags:
            store.gate.clear()
        else:
            store.gate.set()
        first.serve(PROMPTS[prompt_index])
        if evict:
            first.backend.evict_prefix_cache(first.cache.size_info.evictable_size)
        first.backend.check_integrity()
    store.gate.set()
    assert first.cache.flush_remote_kv(WAIT_S)
    stats = first.cache.remote_kv.stats
    assert stats.queued_pages == stats.written_pages + stats.unwritten_pages + stats.dropped_pages
    assert stats.errors_other == 0
    for prompt in PROMPTS:  # what the store holds of each prompt is exact (checked inside serve)
        Server(GatedStore(registry)).serve(prompt)
    first.backend.check_integrity()
