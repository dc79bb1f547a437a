"""``--kvplug-remote-kv URL`` on SGLang 0.5.23 (issue 30), on the CPU: the flag parses, the URL
reaches the scheduler's radix-cache factory through the environment and never through
``ServerArgs`` (which SGLang logs) or the radix-cache backend name; it is refused, saying what was
expected with the password redacted, without a host tier, with a non-radix cache or without
``--kv-backend kvplug``; and two SGLang tree caches built by the factory on one password-protected
``redis-server`` share a prefix: what the first evicts, the second (a fresh pool that never
computed it) loads through its host tier, K/V bit-identical."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from tests.redis_server import REDIS_SERVER, SKIP_REASON, redis_server
from tests.sglang_helpers import EVICT_ALL, build_context, cache_params, finish, import_sglang, make_pools

import_sglang()

from kvplug_sglang import remote_kv  # noqa: E402
from kvplug_sglang.pools import KvplugMHATokenToKVPool  # noqa: E402
from kvplug_sglang.radix_backends import build_prefix_cache  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from tests.test_sglang_host_tier import (  # noqa: E402
    DIM, HEADS, LAYERS, TierWorld, admit, prompt_of, row_kv, sglang_with_plugins,  # noqa: F401 (the fixture)
)

PASSWORD = "pw-sglang-30"
URL = f"redis://:{PASSWORD}@127.0.0.1:6399/0"
HOST = ("--kv-backend", "kvplug", "--kvplug-host-memory", "64MiB")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """Each test starts without a published store and leaves none behind."""
    monkeypatch.delenv(remote_kv.ENV, raising=False)
    yield
    monkeypatch.delenv(remote_kv.ENV, raising=False)


def parse(*flags: str):
    return prepare_server_args(["--model-path", "dummy", *flags])


def test_the_url_is_published_in_the_environment_and_absent_from_server_args():
    import os

    argv = ["--model-path", "dummy", *HOST, "--kvplug-remote-kv", URL]
    args = prepare_server_args(argv)
    assert os.environ[remote_kv.ENV] == URL
    # SGLang keeps (and serves at /server_info) the command line it parsed: redacted in place
    assert PASSWORD not in str(args.launch_command) and "redis://***@127.0.0.1:6399/0" in str(args.launch_command)
    assert argv[-1] == "redis://***@127.0.0.1:6399/0"
    equals = prepare_server_args(["--model-path", "dummy", *HOST, f"--kvplug-remote-kv={URL}"])
    assert os.environ[remote_kv.ENV] == URL and PASSWORD not in str(equals.launch_command)
    assert args.radix_cache_backend == "kvplug:radix+host_memory=67108864"
    # SGLang logs ServerArgs whole (its repr) and its fields: neither holds the password
    assert PASSWORD not in repr(args) and PASSWORD not in str(vars(args))
    assert remote_kv.model_id(args) == "dummy"  # SGLang's --served-model-name default: the model path
    named = parse(*HOST, "--kvplug-remote-kv", URL, "--served-model-name", "tiny-llama")
    assert remote_kv.model_id(named) == "tiny-llama"
    # a later parse without the flag clears what an earlier one published (no inherited store)
    parse(*HOST)
    assert remote_kv.ENV not in os.environ


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--kvplug-remote-kv", URL), "needs --kv-backend kvplug and --kvplug-host-memory"),
        (("--kv-backend", "kvplug", "--kvplug-remote-kv", URL), "expected prefix_cache_options with 'host_memory'"),
        ((*HOST, "--prefix-cache", "naive", "--kvplug-remote-kv", URL), "'naive'"),
        (("--kv-backend", "kvplug", "--prefix-cache", "naive", "--kvplug-remote-kv", URL), "expected prefix_cache='radix'"),
    ],
)
def test_the_flag_is_refused_saying_what_was_expected_with_the_password_redacted(flags, expected, capsys):
    import os

    with pytest.raises(SystemExit) as exit_info:
        parse(*flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and PASSWORD not in err
    if "--kvplug-host-memory" not in expected and "'naive'" != expected:
        assert "redis://***@127.0.0.1:6399/0" in err
    assert remote_kv.ENV not in os.environ  # nothing published on a refusal


def test_the_sglang_host_object_carries_the_store_as_the_flag_does():
    """``SGLangHost(remote_kv=URL)``: its ``cli_args`` parse to the same fields and publish the URL;
    ``install()`` publishes it for ``sglang.Engine``; its repr never shows the password; a store
    without a host tier or over ``naive`` is refused with kvplug's error, redacted."""
    import os

    import kvplug
    from kvplug_sglang.host import SGLangHost

    host = SGLangHost(prefix_cache="radix", attention="torch", host_memory="64MiB", remote_kv=URL)
    args = parse(*host.cli_args())
    assert os.environ[remote_kv.ENV] == URL and PASSWORD not in str(args.launch_command)
    for field, value in host.engine_kwargs().items():
        assert getattr(args, field) == value
    assert PASSWORD not in repr(host) and "redis://***@127.0.0.1:6399/0" in repr(host)
    del os.environ[remote_kv.ENV]
    assert host.install() is True and os.environ[remote_kv.ENV] == URL
    assert SGLangHost(prefix_cache="radix", host_memory="64MiB").install() and remote_kv.ENV not in os.environ
    for kwargs, expected in (({"host_memory": None}, "expected prefix_cache_options with 'host_memory'"),
                             ({"prefix_cache": "naive", "host_memory": "64MiB"}, "expected prefix_cache='radix'")):
        with pytest.raises(kvplug.InvalidArgumentError, match=expected) as info:
            SGLangHost(**{"prefix_cache": "radix", **kwargs, "remote_kv": URL})
        assert PASSWORD not in str(info.value)


def test_the_check_raises_kvplugs_invalid_argument_error():
    import kvplug

    with pytest.raises(kvplug.InvalidArgumentError, match=r"expected prefix_cache_options with 'host_memory'") as info:
        remote_kv.check(URL, "radix", None)
    assert PASSWORD not in str(info.value) and "***@" in str(info.value)
    with pytest.raises(kvplug.InvalidArgumentError, match=r"expected prefix_cache='radix', got 'naive'"):
        remote_kv.check(URL, "naive", 1 << 20)
    remote_kv.check(URL, "radix", 1 << 20)


def test_over_a_factory_without_a_host_tier_a_published_store_is_refused(monkeypatch):
    monkeypatch.setenv(remote_kv.ENV, URL)
    table, allocator = make_pools(size=32, page_size=1, max_requests=2, max_context=16)
    with pytest.raises(ValueError, match=r"expected --radix-cache-backend kvplug:radix\+host_memory=BYTES") as info:
        build_prefix_cache(build_context(cache_params(table, allocator, 1)), name="radix")
    assert PASSWORD not in str(info.value)


def store_world(page_size: int, model: str) -> TierWorld:
    """A kvplug KV pool and SGLang allocator, the tree cache built by the factory as the scheduler
    does, for served model ``model`` (the store URL comes from the environment)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    kv = KvplugMHATokenToKVPool(
        size=64, page_size=page_size, dtype=torch.float32, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
        device="cpu", enable_memory_saver=False,
    )
    table, _ = make_pools(size=64, page_size=page_size, max_requests=6, max_context=64)
    allocator = PagedTokenToKVPoolAllocator(64, page_size, torch.float32, "cpu", kv, need_sort=True)
    ctx = build_context(cache_params(table, allocator, page_size))
    ctx.server_args = SimpleNamespace(served_model_name=model, model_path="/models/" + model)
    world = TierWorld(build_prefix_cache(ctx, name="radix", host_memory=1 << 20), allocator, table, page_size)
    world.kv = kv
    return world


@pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)
def test_two_factory_built_caches_share_a_prefix_through_redis(monkeypatch):
    page = 4
    with redis_server("--requirepass", PASSWORD) as (port, _):
        url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
        monkeypatch.setenv(remote_kv.ENV, url)
        first, second, other = store_world(page, "tiny"), store_world(page, "tiny"), store_world(page, "other")
        prompt = prompt_of(page, 4)
        request, loaded = admit(first, "a", prompt, [901, 902, 903], seed=1)
        assert loaded == 0
        cached = (len(prompt) + 3) // page * page
        before = row_kv(first, request, cached)
        finish(first, "a")
        assert first.cache.evict(EvictParams(num_tokens=EVICT_ALL)).num_tokens_evicted == cached
        assert first.cache.tier_stats().remote_written_pages == cached // page

        # another model's keys never match: a recompute
        _, other_loaded = admit(other, "c", prompt + [901, 902, 903, 904, 905], [7], seed=3)
        assert other_loaded == 0
        # the second cache never computed the prompt: the store brings it into its host tier, then the device
        hit, loaded = admit(second, "b", prompt + [901, 902, 903, 904, 905], [7], seed=2)
        assert loaded == cached == hit.prefix_len
        assert torch.equal(row_kv(second, hit, cached), before)
        assert second.cache.tier_stats().remote_hit_tokens == cached
        assert second.cache.tier_stats().remote_blocking_reads == 1  # never prefetched: read at admission
        second.cache.sanity_check()

        # SGLang queues a request: the hook after Scheduler._prefetch_kvcache prefetches its prompt,
        # and the admission's match takes the staged pages (no store call on the scheduler thread)
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        from kvplug_sglang.hooks import after_prefetch_kvcache

        third = store_world(page, "tiny")
        queued = prompt + [901, 902, 903, 904, 905]
        req = Req(rid="q", origin_input_text="", origin_input_ids=array("q", queued),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=2))
        assert after_prefetch_kvcache("result", SimpleNamespace(tree_cache=third.cache), req) == "result"
        tier = third.cache._spaces.get((None, None), touch=False).cache
        assert tier.flush_prefetches(10.0)
        hit, loaded = admit(third, "q", queued, [7], seed=4)
        assert loaded == cached == hit.prefix_len
        assert torch.equal(row_kv(third, hit, cached), before)
        stats = third.cache.tier_stats()
        assert stats.remote_prefetch_hit_tokens == stats.remote_hit_tokens == cached, stats
        assert stats.remote_blocking_reads == 0 and stats.remote_prefetches == 1, stats
        third.cache.sanity_check()
