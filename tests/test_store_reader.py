"""The shared KV store's reads for queued prompts (issue 30, ``StoreReader``): a prefetched prompt
is admitted without a store call on the serving thread and with the K/V the recompute gives; an
admission waits for a running prefetch at most the timeout, then it is a miss; store faults are
misses, counted; staged bytes are bounded and never outlive their admission."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch
import pytest

import kvplug
from kvplug.interface import KVStoreError
from kvplug.interface.kv_store import BaseKVStore
from kvplug.kv_store import KVNamespace, RemoteKV
from kvplug.prefix_cache.store_reader import NONE, READY, TIMED_OUT, StoreReader
from tests.test_kv_store_tier import PAGE, PROMPT, Server

MANAGER = kvplug.PluginManager(entry_points=False)
WAIT_S = 10.0  # a bound on waits that should end at once; never reached when the code is right
PAGES = 6  # whole pages of PROMPT[:-1] (admission matches at most n - 1 tokens)


class RecordingStore(BaseKVStore):
    """An in-memory store that records each call's thread; ``gate`` holds ``get``; ``fail`` raises;
    ``corrupt`` answers garbage."""

    concurrent_calls = True

    def __init__(self, registry):
        self.inner = MANAGER.create_kv_store("memory://shared", registry=registry)
        self.calls: list[tuple[str, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.in_get = threading.Event()
        self.fail = None
        self.corrupt = False

    def _record(self, operation):
        self.calls.append((operation, threading.current_thread().name))
        if self.fail is not None and operation != "put":
            raise self.fail

    def exists(self, keys):
        self._record("exists")
        return self.inner.exists(keys)

    def put(self, keys, pages):
        self._record("put")
        return self.inner.put(keys, pages)

    def get(self, keys):
        self._record("get")
        self.in_get.set()
        assert self.gate.wait(WAIT_S), "the test never opened the store's gate"
        values = self.inner.get(keys)
        return [b"\x00" * len(value) if value is not None else None for value in values] if self.corrupt else values

    def describe(self):
        return "recording-memory"

    def serving_thread_calls(self):
        serving = threading.current_thread().name
        return [operation for operation, thread in self.calls if thread == serving]


def _written(registry, prompt=PROMPT):
    """A first server computes ``prompt`` and evicts it: to host memory and through to the store."""
    first = Server(MANAGER.create_kv_store("memory://shared", registry=registry))
    assert first.serve(prompt) == 0
    first.backend.evict_prefix_cache(first.cache.size_info.evictable_size)
    assert first.cache.remote_kv.stats.written_pages >= PAGES


def _reader_server(store, **options):
    return Server(store, options={"remote_kv_prefetch_memory": 1 << 20, **options})


def test_a_prefetched_prompt_is_admitted_without_a_store_call_on_the_serving_thread():
    registry = {}
    _written(registry)
    store = RecordingStore(registry)
    second = _reader_server(store)
    caller = threading.Thread(target=second.backend.prefetch, args=(PROMPT,), name="http-thread")  # any thread
    caller.start()
    caller.join()
    assert second.cache.flush_prefetches(WAIT_S)
    assert {thread for _, thread in store.calls} == {"kvplug-store-reader"}
    staged = second.cache.tier_stats()
    assert staged.remote_prefetches == 1 and staged.remote_prefetch_staged_bytes > 0
    store.calls.clear()
    matched = second.serve(PROMPT)  # checks the matched K/V against the recompute's
    assert matched == PAGES * PAGE, "the prefetched pages were not used"
    assert store.serving_thread_calls() == [], f"the admission called the store: {store.calls}"
    tier = second.cache.tier_stats()
    assert tier.remote_prefetch_hit_tokens == tier.remote_hit_tokens == PAGES * PAGE
    assert tier.remote_blocking_reads == 0 and tier.remote_prefetch_timeouts == 0
    assert tier.remote_prefetch_staged_bytes == 0  # taken: the staged bytes are gone
    # not prefetched: the one blocking path, on the serving thread, counted
    third = _reader_server(RecordingStore(registry))
    assert third.serve(PROMPT) == PAGES * PAGE
    assert third.cache.remote_kv.store.serving_thread_calls() == ["exists", "get"]
    assert third.cache.tier_stats().remote_blocking_reads == 1


def test_a_prompt_of_whole_pages_is_matched_short_of_its_last_token():
    """The prefetch stages every whole page; the admission matches at most ``n - 1`` tokens."""
    registry = {}
    prompt = PROMPT[: PAGES * PAGE]  # six whole pages: the admission may match five
    _written(registry, PROMPT)
    second = _reader_server(RecordingStore(registry))
    assert second.backend.prefetch(prompt) and second.cache.flush_prefetches(WAIT_S)
    assert second.serve(prompt) == (PAGES - 1) * PAGE
    assert second.cache.tier_stats().remote_prefetch_hit_tokens == (PAGES - 1) * PAGE


def test_an_admission_waits_for_a_running_prefetch_at_most_the_timeout():
    registry = {}
    _written(registry)
    store = RecordingStore(registry)
    timeout = 0.3
    second = _reader_server(store, remote_kv_prefetch_timeout_s=timeout)
    store.gate.clear()
    assert second.backend.prefetch(PROMPT)
    assert store.in_get.wait(WAIT_S)
    began = time.monotonic()
    assert second.serve(PROMPT) == 0  # still running after the timeout: a miss
    waited = time.monotonic() - began
    assert timeout <= waited < timeout + 2.0, waited
    assert "get" not in store.serving_thread_calls() and "exists" not in store.serving_thread_calls()
    store.gate.set()
    assert second.cache.flush_prefetches(WAIT_S)
    tier = second.cache.tier_stats()
    assert tier.remote_prefetch_timeouts == 1 and tier.remote_prefetch_dropped == 1
    assert tier.remote_prefetch_staged_bytes == 0 and tier.remote_hit_tokens == 0 and tier.remote_blocking_reads == 0
    # a prefetch that ends within the wait is used
    third = _reader_server(RecordingStore(registry), remote_kv_prefetch_timeout_s=WAIT_S)
    third_store = third.cache.remote_kv.store
    third_store.gate.clear()
    assert third.backend.prefetch(PROMPT)
    assert third_store.in_get.wait(WAIT_S)
    threading.Timer(0.1, third_store.gate.set).start()
    assert third.serve(PROMPT) == PAGES * PAGE
    assert third.cache.tier_stats().remote_prefetch_hit_tokens == PAGES * PAGE
    assert third_store.serving_thread_calls() == []


@pytest.mark.parametrize("fault", ["unavailable", "timeout", "bug", "corrupt"])
def test_store_faults_during_a_prefetch_are_misses_counted(fault):
    registry = {}
    _written(registry)
    store = RecordingStore(registry)
    if fault == "corrupt":
        store.corrupt = True
    else:
        store.fail = RuntimeError("a plugin bug") if fault == "bug" else KVStoreError("down", reason=fault)
    second = _reader_server(store)
    assert second.backend.prefetch(PROMPT)
    assert second.cache.flush_prefetches(WAIT_S)
    store.calls.clear()
    assert second.serve(PROMPT) == 0  # a recompute, never an exception
    assert store.serving_thread_calls() == []  # a prefetch that found nothing: no second try at admission
    tier = second.cache.tier_stats()
    if fault == "corrupt":
        assert tier.remote_corrupt_pages == 1
    else:
        assert tier.remote_errors == 1
    assert tier.remote_hit_tokens == 0 and tier.remote_blocking_reads == 0
    second.backend.check_integrity()


def test_staged_bytes_are_bounded_dropping_the_oldest():
    namespace = KVNamespace("tiny", "mha:test", PAGE, "float32")
    remote = RemoteKV(MANAGER.create_kv_store("memory://bounded", registry={}), namespace)
    prompts = [np.arange(start, start + 4 * PAGE + 1, dtype=np.int32) for start in (0, 100, 200)]
    page = b"x" * 64
    for prompt in prompts:
        assert remote.store_pages(prompt, [page] * 4) == 4
    reader = StoreReader(remote, len(page), max_staged_bytes=6 * len(page), max_records=2)
    assert reader.submit(prompts[0]) and reader.flush(WAIT_S)
    assert not reader.submit(prompts[0])  # already staged: coalesced
    assert reader.submit(prompts[1]) and reader.flush(WAIT_S)
    stats = reader.stats
    assert stats.staged_bytes <= 6 * len(page) and stats.dropped == 1  # the oldest made room
    assert reader.take(prompts[0][: 4 * PAGE], 0, 0.0).status == NONE
    assert reader.submit(prompts[2]) and reader.flush(WAIT_S)  # a third: the oldest staged one makes room again
    assert reader.stats.dropped == 2 and reader.take(prompts[1][: 4 * PAGE], 0, 0.0).status == NONE
    taken = reader.take(prompts[2][: 4 * PAGE], 1, 0.0)
    assert taken.status == READY and [bytes(payload) for payload in taken.payloads] == [page] * 3
    assert reader.stats.staged_bytes == 0 and reader.stats.taken_pages == 3
    # pages an admission holds are not fetched again by the next prefetch reaching them
    longer = np.concatenate([prompts[2][: 4 * PAGE], np.full(2 * PAGE + 1, 7, dtype=np.int32)])
    assert remote.store_pages(longer, [page] * 6) == 6
    loaded = remote.stats.loaded_pages
    assert reader.submit(longer) and reader.flush(WAIT_S)
    assert reader.stats.skipped_local_pages == 4 and remote.stats.loaded_pages == loaded + 2
    assert reader.take(longer[: 6 * PAGE], 4, 0.0).payloads == reader_payloads(remote, longer, 4, 2)
    assert reader.take(prompts[0][: 4 * PAGE], 0, 1.0).status == NONE
    reader.close()


def reader_payloads(remote, prompt, start, count):
    return tuple(remote.load(prompt, start, count))


def test_a_running_prefetch_times_out_in_the_reader_alone():
    namespace = KVNamespace("tiny", "mha:test", PAGE, "float32")
    store = RecordingStore({})
    remote = RemoteKV(store, namespace)
    prompt = np.arange(4 * PAGE + 1, dtype=np.int32)
    remote.store_pages(prompt, [b"y" * 64] * 4)
    reader = StoreReader(remote, 64, max_staged_bytes=1 << 20)
    store.gate.clear()
    assert reader.submit(prompt) and store.in_get.wait(WAIT_S)
    assert reader.take(prompt[: 4 * PAGE], 0, 0.05) == (TIMED_OUT, ())
    store.gate.set()
    assert reader.flush(WAIT_S)
    assert reader.stats.staged_bytes == 0 and reader.stats.timeouts == 1 and reader.stats.dropped == 1


def test_prefetch_options_are_validated_and_a_cache_without_a_store_prefetches_nothing():
    with pytest.raises(kvplug.InvalidArgumentError, match="without remote_kv"):
        kvplug.create_prefix_cache("radix", page_size=PAGE, host_memory=1 << 20, remote_kv_prefetch_timeout_s=1.0)
    with pytest.raises(kvplug.InvalidArgumentError, match="remote_kv_prefetch_timeout_s"):
        kvplug.create_prefix_cache(
            "radix",
            page_size=PAGE,
            host_memory=1 << 20,
            remote_kv="memory://x",
            remote_kv_model="m",
            remote_kv_prefetch_timeout_s=-1,
        )
    from kvplug.memory.model_shape import ModelShape

    plain = kvplug.create_backend(
        ModelShape(2, 2, 2, 4, torch.float32),
        page_size=PAGE,
        num_pages=8,
        attention=None,
        prefix_cache_options={"host_memory": 1 << 20},
    )
    assert plain.prefetch(PROMPT) is False
    with pytest.raises(kvplug.InvalidArgumentError):
        plain.prefetch([-1, 2])
    assert Server(MANAGER.create_kv_store("memory://short", registry={})).backend.prefetch([1, 2]) is False
