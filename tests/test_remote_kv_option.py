"""``kvplug.create_backend(..., remote_kv=URL, remote_kv_model=ID)`` (issue 30), through the public
API only, against a real ``redis-server`` on 127.0.0.1: what one backend evicts, another built with
the keyword loads, K/V identical to recompute; the keyword is the same store as the
``prefix_cache_options`` spelling; without a host tier it is refused, saying what was expected."""

from __future__ import annotations

import pytest
import torch

import kvplug
from kvplug.memory.model_shape import ModelShape
from tests.redis_server import REDIS_SERVER, SKIP_REASON, redis_server
from tests.test_kv_store_tier import HEAD_DIM, KV_HEADS, LAYERS, PAGE, PROMPT, fingerprint

PASSWORD = "pw-option-30"
SHAPE = ModelShape(LAYERS, 2, KV_HEADS, HEAD_DIM, torch.float32)
HOST = {"host_memory": 16 * SHAPE.kv_bytes_per_token() * PAGE}

needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)


@pytest.fixture
def redis_url():
    """A fresh password-protected ``redis-server`` on a free port; its URL and process."""
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    with redis_server("--requirepass", PASSWORD) as (port, process):
        yield f"redis://:{PASSWORD}@127.0.0.1:{port}/0", process


def backend(url=None, model="tiny", *, options=HOST, **keywords):
    return kvplug.create_backend(
        SHAPE, page_size=PAGE, num_pages=8, max_running_reqs=4, max_seq_len=16 * PAGE, attention=None,
        prefix_cache="radix", prefix_cache_options=options, remote_kv=url, remote_kv_model=model, **keywords,
    )


def serve(backend, tokens):
    """Admit (checking the matched K/V against the recompute), compute the rest, finish; the matched length."""
    rows = backend.pool.kv_buffer.view(2, LAYERS, -1, KV_HEADS, HEAD_DIM)
    request = backend.admit(tokens)
    matched = request.matched_len
    locations = backend.page_table[request.row, :matched].long()
    assert torch.equal(rows[:, :, locations], fingerprint(tokens, 0, matched, torch.float32))
    backend.allocate([request])
    out = backend.page_table[request.row, request.cached_len:request.device_len].long()
    rows[:, :, out] = fingerprint(tokens, request.cached_len, request.device_len, torch.float32)
    backend.finish(request, computed=True)
    backend.check_integrity()
    return matched


@needs_redis
def test_a_backend_built_with_the_keyword_loads_what_another_evicted(redis_url):
    url, _ = redis_url
    first, second = backend(url), backend(url)
    assert serve(first, PROMPT) == 0
    first.evict_prefix_cache(6 * PAGE)
    assert first.prefix_cache.tier_stats().remote_written_pages == 6
    assert serve(second, PROMPT) == 6 * PAGE, "the second backend recomputed a prefix the store holds"
    tier = second.prefix_cache.tier_stats()
    assert tier.remote_hit_tokens == 6 * PAGE and tier.remote_errors == tier.remote_corrupt_pages == 0
    assert second.stats().host_hit_tokens == 6 * PAGE  # the store's pages came in through the host tier
    assert serve(backend(url, model="another-model"), PROMPT) == 0  # another model's keys: never loaded


@needs_redis
def test_the_keyword_and_the_prefix_cache_option_are_one_store(redis_url):
    """Differential: a backend given the store through ``prefix_cache_options`` writes; one given
    the keyword reads the same keys (and the other way round)."""
    url, _ = redis_url
    spelled = backend(options={**HOST, "remote_kv": url, "remote_kv_model": "tiny"}, model=None)
    serve(spelled, PROMPT)
    spelled.evict_prefix_cache(6 * PAGE)
    assert serve(backend(url), PROMPT) == 6 * PAGE
    other = [40 + index % 7 for index in range(4 * PAGE + 1)]
    keyword = backend(url)
    serve(keyword, other)
    keyword.evict_prefix_cache(4 * PAGE)
    assert serve(backend(options={**HOST, "remote_kv": url, "remote_kv_model": "tiny"}, model=None), other) == 4 * PAGE


@needs_redis
def test_a_dead_store_or_a_wrong_password_is_a_recompute(redis_url):
    url, process = redis_url
    wrong = url.replace(PASSWORD, "not-the-password")
    first = backend(url)
    serve(first, PROMPT)
    first.evict_prefix_cache(6 * PAGE)
    refused = backend(wrong)
    assert serve(refused, PROMPT) == 0  # refused credentials: a miss, counted, no exception
    assert refused.prefix_cache.remote_kv.stats.errors_auth >= 1
    process.kill()
    process.wait()
    survivor = backend(url)
    assert serve(survivor, PROMPT) == 0
    assert survivor.prefix_cache.tier_stats().remote_errors >= 1
    assert serve(first, PROMPT) == 6 * PAGE  # the first still serves from its own host tier


@pytest.mark.parametrize(
    "keywords, expected",
    [
        ({"options": None}, "expected prefix_cache_options with 'host_memory'"),
        ({"options": {"host_memory": None}}, "expected prefix_cache_options with 'host_memory'"),
        ({"prefix_cache": "naive"}, "expected prefix_cache='radix', got 'naive'"),
        ({"model": None}, "needs remote_kv_model.*expected a non-empty str, got None"),
        ({"model": ""}, "needs remote_kv_model.*got ''"),
        ({"options": {**HOST, "remote_kv": "memory://x", "remote_kv_model": "m"}}, "given twice"),
    ],
)
def test_the_keyword_is_refused_without_a_host_tier_or_a_model(keywords, expected):
    url = f"redis://:{PASSWORD}@127.0.0.1:1/0"
    options = keywords.pop("options", HOST)
    model = keywords.pop("model", "tiny")
    with pytest.raises(kvplug.InvalidArgumentError, match=expected) as error:
        kwargs = {"prefix_cache": keywords["prefix_cache"]} if "prefix_cache" in keywords else {}
        kvplug.create_backend(SHAPE, page_size=PAGE, num_pages=8, max_running_reqs=4, max_seq_len=64,
                              attention=None, prefix_cache_options=options, remote_kv=url,
                              remote_kv_model=model, **kwargs)
    assert PASSWORD not in str(error.value) and "redis://***@127.0.0.1:1/0" in str(error.value)


def test_other_misuses_of_the_keyword_are_refused():
    with pytest.raises(kvplug.InvalidArgumentError, match="remote_kv_model='m' is given without remote_kv"):
        backend(None, model="m")
    cache = kvplug.create_prefix_cache("radix", page_size=PAGE)
    with pytest.raises(kvplug.InvalidArgumentError, match="expected prefix_cache='radix', got 'RadixPrefixCache'"):
        kvplug.create_backend(SHAPE, page_size=PAGE, num_pages=8, max_running_reqs=4, max_seq_len=64,
                              attention=None, prefix_cache=cache, remote_kv="memory://x", remote_kv_model="m")
    with pytest.raises(kvplug.InvalidArgumentError, match="a store URL or a kvplug.BaseKVStore, got int"):
        backend(1234)
    with pytest.raises(kvplug.UnknownComponentError):
        backend("nosuchstore://x")


def test_the_keyword_takes_a_store_instance():
    """A ``BaseKVStore`` object works as the URL does (here the in-process reference store)."""
    registry: dict = {}
    manager = kvplug.PluginManager(entry_points=False)

    def store():
        return manager.create_kv_store("memory://shared", registry=registry)

    first = backend(store())
    serve(first, PROMPT)
    first.evict_prefix_cache(6 * PAGE)
    assert serve(backend(store()), PROMPT) == 6 * PAGE
