"""Shared KV stores without a server (issue 30): the plugin kind, keys, framing, ``RemoteKV``'s fault
containment, and the conformance kit on the in-memory reference store."""

from __future__ import annotations

import logging

import pytest

import kvplug
import kvplug.testing as kit
from kvplug.interface.kv_store import redact_url
from kvplug.kv_store import KVNamespace, RemoteKV, page_keys
from kvplug.kv_store.framing import frame, unframe
from kvplug.kv_store.memory_store import InMemoryKVStore

NAMESPACE = KVNamespace("tiny-llama", "mha:L2:H2:D8:kv", 4, "bfloat16")
PROMPT = list(range(100, 118))  # four whole pages and a partial one


def memory_store(registry=None, **options) -> InMemoryKVStore:
    return InMemoryKVStore(kvplug.KVStoreConfig("memory://test", {"registry": registry, **options}))


_SHARED: dict = {}


@kit.parametrize_kv_store_checks()
def test_memory_store_conforms(kv_store_check):
    kv_store_check.run(lambda: memory_store(_SHARED))


def test_kit_fails_a_store_that_loses_bytes():
    class Lossy(InMemoryKVStore):
        def get(self, keys):
            return [value[:-1] if value else value for value in super().get(keys)]

    with pytest.raises(AssertionError, match="round_trip_is_byte_identical"):
        kit.check_kv_store(lambda: Lossy(kvplug.KVStoreConfig("memory://lossy")), shared=False)


def test_kit_fails_a_store_whose_exists_ignores_gaps():
    class Counting(InMemoryKVStore):
        def exists(self, keys):
            return sum(value is not None for value in self.get(keys))

    with pytest.raises(AssertionError, match="exists_counts_the_stored_prefix"):
        kit.check_kv_store(lambda: Counting(kvplug.KVStoreConfig("memory://counting")), shared=False)


def test_store_kind_is_registered_by_name_and_chosen_by_url_scheme():
    manager = kvplug.PluginManager(entry_points=False)
    assert {"redis", "mooncake", "memory"} <= set(manager.available("kv_store"))
    assert manager.providers("kv_store")["redis"] == "kvplug.builtin.kv_stores"
    assert manager.providers("kv_store")["mooncake"] == "kvplug.builtin.kv_stores"
    assert isinstance(manager.create_kv_store("memory://x"), kvplug.BaseKVStore)
    with pytest.raises(kvplug.UnknownComponentError, match="'redis'"):
        manager.create_kv_store("s3://bucket/pages")
    # the prefix-cache kinds are untouched
    assert {"naive", "radix"} <= set(manager.available("prefix_cache"))


def test_third_party_store_registers_through_the_hook():
    class FileLikeStore(InMemoryKVStore):
        pass

    class Plugin:
        @kvplug.hookimpl
        def kvplug_register_kv_stores(register):
            register("thirdparty", lambda config: FileLikeStore(config))

    manager = kvplug.PluginManager(entry_points=False)
    manager.register(Plugin, "third-party-store")
    assert isinstance(manager.create_kv_store("thirdparty://bucket"), FileLikeStore)
    assert manager.providers("kv_store")["thirdparty"] == "third-party-store"
    assert any(info.provides.get("kv_store") == ["thirdparty"] for info in manager.plugins())


def test_a_factory_returning_a_non_store_is_refused():
    class Plugin:
        @kvplug.hookimpl
        def kvplug_register_kv_stores(register):
            register("bogus", lambda config: object())

    manager = kvplug.PluginManager(entry_points=False)
    manager.register(Plugin, "bogus-store")
    with pytest.raises(kvplug.PluginRegistrationError, match="BaseKVStore"):
        manager.create_kv_store("bogus://x")


@pytest.mark.parametrize(
    "change",
    [{"model": "other-model"}, {"layout": "mha:L2:H2:D8:vk"}, {"page_size": 2}, {"dtype": "float16"},
     {"tp_rank": 1, "tp_size": 2}, {"tp_size": 2}],
)
def test_a_namespace_mismatch_never_shares_a_key(change):
    import dataclasses

    other = dataclasses.replace(NAMESPACE, **change)
    assert not set(page_keys(NAMESPACE, PROMPT)) & set(page_keys(other, PROMPT))
    registry: dict = {}
    writer, reader = RemoteKV(memory_store(registry), NAMESPACE), RemoteKV(memory_store(registry), other)
    assert writer.store_pages(PROMPT, [b"page"] * 4) == 4
    assert reader.lookup(PROMPT) == 0 and reader.load(PROMPT, 0, 4) == []


def test_keys_are_chained_over_the_whole_prefix():
    keys = page_keys(NAMESPACE, PROMPT)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert page_keys(NAMESPACE, PROMPT[:8]) == keys[:2]  # a prefix has the prefix's keys
    changed = PROMPT.copy()
    changed[1] += 1  # a change in page 0 changes every later key
    assert not set(page_keys(NAMESPACE, changed)) & set(keys)
    later = PROMPT.copy()
    later[9] += 1
    assert page_keys(NAMESPACE, later)[:2] == keys[:2] and page_keys(NAMESPACE, later)[2] != keys[2]
    assert all(key.startswith(NAMESPACE.prefix) for key in keys)


def test_framing_rejects_flips_truncation_and_another_keys_value():
    value = frame("k1", b"\x00payload\r\n")
    assert bytes(unframe("k1", value)) == b"\x00payload\r\n"
    for index in range(len(value)):
        damaged = bytearray(value)
        damaged[index] ^= 1
        assert unframe("k1", bytes(damaged)) is None, f"a flip at byte {index} went unnoticed"
    assert unframe("k1", value[:-1]) is None and unframe("k1", b"") is None
    assert unframe("k2", value) is None


def test_remote_round_trip_and_partial_prefix():
    registry: dict = {}
    writer, reader = RemoteKV(memory_store(registry), NAMESPACE), RemoteKV(memory_store(registry), NAMESPACE)
    pages = [bytes([index]) * 64 for index in range(4)]
    assert writer.store_pages(PROMPT, pages[:2]) == 2
    assert writer.store_pages(PROMPT, pages[2:3], start_page=2) == 1
    assert reader.lookup(PROMPT) == 3 and reader.lookup(PROMPT, start_page=1) == 2
    assert [bytes(page) for page in reader.load(PROMPT, 1, 3)] == pages[1:3]
    assert reader.stats.loaded_pages == 2 and reader.stats.lookup_hit_pages == 5
    with pytest.raises(kvplug.InvalidArgumentError, match="only 4 whole pages"):
        writer.store_pages(PROMPT, pages + [b"x"])
    with pytest.raises(kvplug.InvalidArgumentError, match="page 1"):
        writer.store_pages(PROMPT, [b"x", "text"])


def test_a_full_store_drops_writes_and_counts_them():
    remote = RemoteKV(memory_store(capacity_bytes=250), NAMESPACE)
    assert remote.store_pages(PROMPT, [b"x" * 100] * 4) == 2
    stats = remote.stats
    assert stats.written_pages == 2 and stats.dropped_pages == 2 and stats.errors_full == 1
    assert remote.lookup(PROMPT) == 2


class _Faulty(kvplug.BaseKVStore):
    """Raises what it is told to, or answers out of contract."""

    def __init__(self, failure):
        self.failure, self.calls = failure, 0

    def _answer(self, good):
        self.calls += 1
        if isinstance(self.failure, BaseException):
            raise self.failure
        return self.failure if self.failure != "good" else good

    def exists(self, keys):
        return self._answer(0)

    def put(self, keys, pages):
        return self._answer(len(keys))

    def get(self, keys):
        return self._answer([None] * len(keys))


@pytest.mark.parametrize(
    "failure, counter",
    [
        (kvplug.KVStoreError("down", reason="unavailable"), "errors_unavailable"),
        (kvplug.KVStoreError("slow", reason="timeout"), "errors_timeout"),
        (kvplug.KVStoreError("auth", reason="auth"), "errors_auth"),
        (kvplug.KVStoreError("junk", reason="protocol"), "errors_protocol"),
        (ZeroDivisionError("plugin bug"), "errors_other"),
        (-1, "errors_other"),  # exists / put out of range, get not a list
    ],
)
def test_store_faults_are_counted_misses_never_exceptions(failure, counter):
    remote = RemoteKV(_Faulty(failure), NAMESPACE, retry_after_s=0)
    assert remote.lookup(PROMPT) == 0
    assert remote.load(PROMPT, 0, 4) == []
    assert remote.store_pages(PROMPT, [b"x"] * 4) == 0
    stats = remote.stats
    assert getattr(stats, counter) == 3 and stats.dropped_pages == 4 and stats.loaded_pages == 0


def test_a_down_store_is_skipped_until_the_retry_interval_passes():
    now = [100.0]
    store = _Faulty(kvplug.KVStoreError("down", reason="unavailable"))
    remote = RemoteKV(store, NAMESPACE, retry_after_s=5, clock=lambda: now[0])
    for _ in range(4):
        assert remote.lookup(PROMPT) == 0
    assert store.calls == 1 and remote.stats.skipped_calls == 3
    now[0] += 5
    store.failure = "good"
    assert remote.store_pages(PROMPT, [b"x"]) == 1 and store.calls == 2


def test_a_wrong_length_get_is_not_loaded():
    store = _Faulty([b"x"])  # one value for four keys
    remote = RemoteKV(store, NAMESPACE)
    assert remote.load(PROMPT, 0, 4) == [] and remote.stats.errors_other == 1


def test_credentials_are_redacted(caplog):
    url = "redis://alice:s3cr%40t@127.0.0.1:1/0"
    config = kvplug.KVStoreConfig(url)
    assert "s3cr" not in repr(config) and "alice" not in config.redacted_url
    assert redact_url(url) == "redis://***@127.0.0.1:1/0"
    with caplog.at_level(logging.DEBUG, logger="kvplug"):
        remote = RemoteKV(kvplug.PluginManager(entry_points=False).create_kv_store(url, timeout=0.2), NAMESPACE)
        assert remote.lookup(PROMPT) == 0  # port 1: nobody listens
    assert remote.stats.errors_unavailable == 1
    text = caplog.text + repr(remote.store) + remote.store.describe() + repr(remote.stats)
    assert "127.0.0.1:1" in caplog.text and "s3cr" not in text and "alice" not in text


@pytest.mark.parametrize("url", ["redis//127.0.0.1", "redis://127.0.0.1/notadb", "redis://:pw@"])
def test_bad_urls_are_invalid_arguments_without_the_password(url):
    with pytest.raises(kvplug.InvalidArgumentError) as error:
        kvplug.PluginManager(entry_points=False).create_kv_store(url)
    assert "pw" not in str(error.value)
