"""kvplug inside SGLang 0.5.23, tested against the installed SGLang package on the CPU.

- SGLang's own plugin loader finds and runs the kvplug plugin; SGLang's own server-argument parser
  then takes ``--kv-backend kvplug --prefix-cache NAME`` and rejects unknown names with kvplug's list.
- Through SGLang's prefix-cache API, request objects and lifecycle helpers (``init_next_round_input``,
  ``alloc_token_slots``, ``checkpoint_kv_cache``, ``release_kv_cache``), a kvplug-backed tree cache
  behaves like SGLang's ``RadixCache`` on the same operation sequence: same matched lengths, same
  evictable/protected sizes, same free locations, same request rows, after every step. Random
  lifecycles evict everything evictable; partial evictions (explicit and on admission) are compared
  in LRU scenarios. The one known difference (SGLang also refreshes the unmatched tail of an edge a
  match splits) is pinned by its own test.
- The attention backend's metadata for an SGLang ``ForwardBatch`` equals kvplug's own builder's,
  and its output equals a dense reference and SGLang's own torch-native backend.
"""

from __future__ import annotations

import functools
import random
from array import array
from types import SimpleNamespace

import pytest
import torch

from tests.sglang_helpers import (
    EVICT_ALL,
    HEAD_DIM,
    KV_HEADS,
    Q_HEADS,
    AttentionWorld,
    admit,
    apply,
    assert_same_state,
    build_context,
    cache_params,
    checkpoint,
    finish,
    import_sglang,
    make_pools,
    make_world,
    page_tokens,
    run_both,
)

SGLANG_VERSION = import_sglang()

import kvplug  # noqa: E402
from kvplug.plugins import PluginManager  # noqa: E402
from kvplug.prefix_cache.radix import RadixPrefixCache  # noqa: E402
from kvplug_sglang import compat, names  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.mem_cache.registry import (  # noqa: E402
    get_radix_cache_factory,
    registered_radix_cache_backends,
)
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins, load_plugins_by_group  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args, set_global_server_args_for_scheduler  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def sglang_with_plugins():
    """SGLang as a server process sees it: plugins loaded, scheduler-side server args published."""
    load_plugins()
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))


def parse(*flags: str) -> ServerArgs:
    return prepare_server_args(["--model-path", "dummy", *flags])


# ============================================================================ plugin and CLI


def test_sglang_plugin_loader_finds_the_kvplug_plugin():
    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert "kvplug" in found
    function, distribution = found["kvplug"]
    assert distribution == "kvplug-sglang"
    assert function.__module__ == "kvplug_sglang.sglang_plugin"


def test_sglang_plugins_whitelist_can_exclude_kvplug(monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "some-other-plugin")
    assert "kvplug" not in load_plugins_by_group(GENERAL_PLUGINS_GROUP)


def test_loading_registered_every_kvplug_component_in_sglang():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins.hook_registry import HookRegistry

    for cache in kvplug.available("prefix_cache"):
        assert names.radix_cache_backend_name(cache) in registered_radix_cache_backends()
    for attention in ("kvplug", "kvplug:torch", "kvplug:triton", "kvplug:flashinfer", "kvplug:fa3"):
        assert attention in ATTENTION_BACKENDS and attention in ATTENTION_BACKEND_CHOICES
    assert "kvplug:torch,triton" in ATTENTION_BACKENDS
    assert {target for target in HookRegistry._patched if "KVCacheConfigurator" in target or "add_cli_args" in target} == {
        "sglang.srt.server_args.ServerArgs.add_cli_args",
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_kv_pool_class",
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_default_req_pool",
    }


def test_parser_accepts_kv_backend_kvplug_with_prefix_cache_radix():
    args = parse("--kv-backend", "kvplug", "--prefix-cache", "radix")
    assert args.radix_cache_backend == "kvplug:radix"
    assert args.attention_backend == "kvplug"
    # decode graphs stay SGLang's choice (kvplug's graph hooks); prefill graphs are not wired
    assert args.cuda_graph_backend_decode is None and args.cuda_graph_backend_prefill == "disabled"


@pytest.mark.parametrize("decode", ["full", "disabled"])
def test_parser_accepts_the_decode_graph_backends_kvplug_supports(decode):
    args = parse("--kv-backend", "kvplug", "--cuda-graph-backend-decode", decode, "--cuda-graph-backend-prefill", "disabled")
    assert (args.cuda_graph_backend_decode, args.cuda_graph_backend_prefill) == (decode, "disabled")


@pytest.mark.parametrize(
    ("flags", "radix_backend", "attention_backend"),
    [
        (("--kv-backend", "kvplug"), "kvplug:radix", "kvplug"),
        (("--kv-backend", "kvplug", "--prefix-cache", "naive"), "kvplug:naive", "kvplug"),
        (("--kv-backend", "kvplug", "--kvplug-attention", "torch"), "kvplug:radix", "kvplug:torch"),
        (("--kv-backend", "kvplug", "--kvplug-attention", "torch,triton"), "kvplug:radix", "kvplug:torch,triton"),
        (("--kv-backend", "kvplug", "--radix-cache-backend", "kvplug:radix"), "kvplug:radix", "kvplug"),
        ((), None, None),
        (("--radix-cache-backend", "kvplug:radix"), "kvplug:radix", None),
    ],
)
def test_parser_translates_kvplug_flags_into_sglang_fields(flags, radix_backend, attention_backend):
    args = parse(*flags)
    assert (args.radix_cache_backend, args.attention_backend) == (radix_backend, attention_backend)


def test_parser_rejects_an_unknown_prefix_cache_listing_kvplug_names(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--kv-backend", "kvplug", "--prefix-cache", "no-such-cache")
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "argument --prefix-cache" in message and "'no-such-cache'" in message
    for name in kvplug.available("prefix_cache"):
        assert f"'{name}'" in message


def test_parser_rejects_an_unknown_kvplug_attention_backend(capsys):
    with pytest.raises(SystemExit):
        parse("--kv-backend", "kvplug", "--kvplug-attention", "torch,nope")
    message = capsys.readouterr().err
    assert "argument --kvplug-attention" in message and "'nope'" in message and "'triton'" in message


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (("--prefix-cache", "radix"), "add --kv-backend kvplug"),
        (("--kvplug-attention", "torch"), "add --kv-backend kvplug"),
        (("--kv-backend", "kvplug", "--radix-cache-backend", "other"), "--radix-cache-backend kvplug:radix"),
        (("--kv-backend", "kvplug", "--attention-backend", "triton"), "--attention-backend kvplug"),
        (("--kv-backend", "kvplug", "--cuda-graph-backend-decode", "breakable"),
         "supports decode graphs captured whole (--cuda-graph-backend-decode full or disabled); got --cuda-graph-backend-decode breakable"),
        (("--kv-backend", "kvplug", "--cuda-graph-backend-prefill", "breakable"),
         "supports no prefill graphs (--cuda-graph-backend-prefill disabled); got --cuda-graph-backend-prefill breakable"),
        (("--kv-backend", "kvplug", "--cuda-graph-backend-prefill", "full"), "got --cuda-graph-backend-prefill full"),
        (("--kv-backend", "kvplug", "--cuda-graph-config", '{"prefill": {"backend": "full"}}'),
         "got --cuda-graph-config prefill.backend full"),
        (("--kv-backend", "kvplug", "--cuda-graph-config", '{"decode": {"backend": "breakable"}}'),
         "got --cuda-graph-config decode.backend breakable"),
    ],
)
def test_parser_rejects_conflicting_flags(flags, complaint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*flags)
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


@kvplug.hookimpl
def kvplug_register_prefix_caches(register):  # a "third-party" plugin: this test module
    register("sglang-test-cache", RadixPrefixCache)


def test_a_third_party_prefix_cache_is_usable_by_name():
    from kvplug_sglang.radix_backends import register_radix_cache_backends

    manager = PluginManager(entry_points=False)
    manager.register(__import__(__name__, fromlist=["_"]), name="sglang-test-plugin")
    kvplug.reset_default_manager(manager)
    try:
        assert register_radix_cache_backends() == ["kvplug:sglang-test-cache"]
        args = parse("--kv-backend", "kvplug", "--prefix-cache", "sglang-test-cache")
        assert args.radix_cache_backend == "kvplug:sglang-test-cache"
        table, allocator = make_pools(size=16, page_size=1, max_requests=2, max_context=16)
        cache = get_radix_cache_factory(args.radix_cache_backend)(build_context(cache_params(table, allocator, 1)))
        cache.insert(InsertParams(key=RadixKey(array("q", [5, 6, 7])), value=torch.tensor([3, 4, 5])))
        assert cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [5, 6, 9])))).device_prefix_len == 2
    finally:
        kvplug.reset_default_manager()


def test_version_gate(monkeypatch):
    assert compat.require_supported_sglang() == SGLANG_VERSION
    with pytest.raises(compat.UnsupportedSGLangError, match="supports SGLang 0.5.23, found 0.5.22"):
        compat.require_supported_sglang("0.5.22", env={})
    assert compat.require_supported_sglang("0.5.22", env={compat.ALLOW_UNTESTED_ENV: "1"}) == "0.5.22"
    monkeypatch.setattr(compat, "installed_sglang_version", lambda: None)
    with pytest.raises(compat.UnsupportedSGLangError, match="SGLang is not installed"):
        compat.require_supported_sglang(env={compat.ALLOW_UNTESTED_ENV: "1"})


def test_kvplug_host_named_sglang():
    host = kvplug.default_manager().create("host", "sglang", prefix_cache="naive", attention="torch")
    assert host.install() is True
    args = parse(*host.cli_args())
    for field, value in host.engine_kwargs().items():
        assert getattr(args, field) == value
    with pytest.raises(kvplug.UnknownComponentError, match="'radix'"):
        kvplug.default_manager().create("host", "sglang", prefix_cache="missing")


# ============================================================================ prefix cache vs SGLang's RadixCache


def random_operations(seed: int, count: int, page_size: int):
    """A serving-like mix: prompts from a few shared-prefix families (so matches end inside cached
    edges and split them), up to three requests in flight (locked prefixes), mid-flight checkpoints
    (chunked prefill), finishes, evictions of everything evictable and partial evictions."""
    rng = random.Random(seed)
    families = [[rng.randrange(1, 50) for _ in range(rng.randrange(2, 5) * page_size)] for _ in range(3)]
    in_flight: list[str] = []
    for number in range(count):
        roll = rng.random()
        if in_flight and (roll < 0.35 or len(in_flight) == 3):
            yield ("finish", in_flight.pop(rng.randrange(len(in_flight))))
        elif in_flight and roll < 0.45:
            yield ("checkpoint", rng.choice(in_flight))
        elif roll < 0.47:
            yield ("evict", EVICT_ALL)
        elif roll < 0.5:  # partial: which entries go depends on the LRU order, split tails included
            yield ("evict", rng.randrange(1, 4) * page_size)
        else:
            family = rng.choice(families)
            prompt = family[: rng.randrange(1, len(family) + 1)] + [rng.randrange(1, 8) for _ in range(rng.randrange(1, 7))]
            output = [rng.randrange(1, 8) for _ in range(rng.randrange(1, 6))]
            in_flight.append(f"r{number}")
            yield ("admit", (f"r{number}", prompt, output))
    for rid in in_flight:
        yield ("finish", rid)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(10))
def test_kvplug_radix_behaves_like_sglang_radix_cache_on_random_lifecycles(seed, page_size):
    # a pool large enough that admission never has to evict: which entries a *partial* eviction
    # picks is compared in the scenario tests below, where the LRU order is spelled out
    operations = list(random_operations(seed, 150, page_size))
    _, candidate = run_both(page_size, operations, size=4096)
    candidate.cache.sanity_check()
    assert candidate.cache.protected_size() == 0  # everything finished: nothing is locked
    assert len(candidate.free_locations()) + candidate.cache.evictable_size() == 4096
    assert sum(kind == "evict" for kind, _ in operations) >= 5


@pytest.mark.parametrize("page_size", [1, 4])
def test_partial_evictions_free_what_sglang_frees_in_lru_order(page_size):
    tokens = functools.partial(page_tokens, page_size)
    operations = [
        ("admit", ("a", tokens(1, 2) + [7], tokens(3))),
        ("finish", "a"),
        ("admit", ("b", tokens(4, 5) + [7], tokens(6))),
        ("finish", "b"),
        ("admit", ("c", tokens(8, 9, 11) + [7], tokens(12))),
        ("finish", "c"),
        # d continues a's whole cached sequence: a becomes the most recently used
        ("admit", ("d", tokens(1, 2) + [7] + tokens(3)[:-1] + [5], tokens(13))),
        ("finish", "d"),
        # e holds b's cached prompt locked while the cache is emptied one eviction at a time
        ("admit", ("e", tokens(4, 5) + [7, 9], tokens(14))),
    ] + [("evict", 1)] * 12
    reference, candidate = run_both(page_size, operations, size=64 * page_size)
    assert candidate.cache.evictable_size() == 0
    assert candidate.cache.protected_size() == reference.cache.protected_size() > 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_admission_evicts_through_the_tree_cache_like_sglang(page_size):
    """A pool so small that each new request makes ``alloc_token_slots`` evict the LRU entries."""
    tokens = functools.partial(page_tokens, page_size)
    operations = []
    for number in range(9):
        family = number % 3 + 1
        # later requests of a family reuse its first request's whole cached prompt
        prompt = tokens(family, 10 + family) + [family] + ([number] if number >= 3 else [])
        operations += [("admit", (f"r{number}", prompt, tokens(20 + number))), ("finish", f"r{number}")]
    evicted = []
    reference, candidate = make_world("sglang", page_size=page_size, size=12 * page_size), None
    original_evict = reference.cache.evict
    reference.cache.evict = lambda params: evicted.append(original_evict(params).num_tokens_evicted) or EvictResult(evicted[-1])
    candidate = make_world("radix", page_size=page_size, size=12 * page_size)
    for step, operation in enumerate(operations):
        apply(reference, operation)
        apply(candidate, operation)
        assert_same_state(reference, candidate, f"step {step}: {operation}")
    assert len(evicted) >= 3 and min(evicted) > 0  # admissions did have to evict


@pytest.mark.parametrize("page_size", [1, 4])
def test_evicting_output_keeps_the_prompt_like_sglang(page_size):
    tokens = functools.partial(page_tokens, page_size)
    operations = [("admit", ("a", tokens(1, 2, 3), tokens(4, 5))), ("finish", "a"), ("evict", 1)]
    reference, candidate = run_both(page_size, operations)
    assert candidate.cache.evictable_size() == reference.cache.evictable_size() == 3 * page_size


@pytest.mark.parametrize("page_size", [1, 2])
def test_a_split_refreshes_the_unmatched_tail_like_sglang(page_size):
    """SGLang stamps a child's recency before comparing keys, so a match that ends inside an edge
    also refreshes the edge's unmatched tail. kvplug's radix is strict LRU by default; the SGLang
    host creates it with ``split_refreshes_tail=True`` so both evict the same locations: the
    newer-stamped tail [3, 4] survives and the older [9] goes first."""
    freed = []
    ids = lambda *tokens: array("q", [token for token in tokens for _ in range(page_size)])  # noqa: E731
    for kind in ("sglang", "radix"):
        world = make_world(kind, page_size=page_size)
        cache, allocator = world.cache, world.allocator
        cache.insert(InsertParams(key=RadixKey(ids(1, 2, 3, 4)), value=allocator.alloc(4 * page_size)))
        cache.insert(InsertParams(key=RadixKey(ids(9)), value=allocator.alloc(page_size)))
        matched = cache.match_prefix(MatchPrefixParams(key=RadixKey(ids(1, 2, 7)))).device_prefix_len
        assert matched == 2 * page_size
        before = set(world.free_locations())
        evicted = cache.evict(EvictParams(num_tokens=page_size)).num_tokens_evicted
        assert evicted == len(set(world.free_locations()) - before)
        freed.append(set(world.free_locations()) - before)
    assert freed[0] == freed[1] and len(freed[0]) == page_size


# ============================================================================ attention backend

from kvplug.attention import build_attention_batch  # noqa: E402
from kvplug.interface import ForwardPhase  # noqa: E402
from kvplug_sglang.attention_backend import KvplugAttnBackend  # noqa: E402
from kvplug_sglang.pools import KvplugMHATokenToKVPool, KvplugReqToTokenPool, UnsupportedKVPoolError  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from tests.attention_reference import dense_attention, one_torch_thread  # noqa: E402,F401

STEPS = [
    # (mode, {request: new tokens}), over requests with cached prefixes 0, 7 and 3
    (ForwardMode.EXTEND, {0: 5, 1: 3, 2: 1}),
    (ForwardMode.DECODE, {0: 1, 1: 1, 2: 1}),
    (ForwardMode.MIXED, {2: 6, 0: 1, 1: 1}),
    (ForwardMode.DECODE, {1: 1, 2: 1}),
]


@pytest.mark.parametrize("page_size", [1, 4])
def test_attention_metadata_equals_kvplugs_own_builder(page_size):
    world = AttentionWorld(page_size, seed=page_size)
    world.add_requests([0, 7, 3])
    backend = KvplugAttnBackend(world.runner, "torch")
    for mode, extend in STEPS:
        cached = [world.lens[request] for request in extend]
        batch = world.forward_batch(mode, extend)
        backend.init_forward_metadata(batch)
        phase = ForwardPhase.DECODE if mode is ForwardMode.DECODE else ForwardPhase.PREFILL
        rows = [world.rows[request] for request in extend]
        expected = build_attention_batch(world.table.req_to_token, rows, cached, batch.seq_lens_cpu, phase)
        got = backend.forward_metadata
        assert got.phase is expected.phase and got.page_table is world.table.req_to_token
        for field in ("table_rows", "cached_lens", "device_lens", "cached_lens_cpu", "device_lens_cpu",
                      "extend_start", "extend_start_cpu", "positions", "out_loc"):
            assert torch.equal(getattr(got, field), getattr(expected, field)), (mode, field)
        # and it agrees with what SGLang itself says about the step
        assert got.out_loc.tolist() == batch.out_cache_loc.tolist()
        assert got.positions.tolist() == batch.positions.tolist()
        world.append_dense(extend, 0, *(world.random(len(batch.out_cache_loc), KV_HEADS, HEAD_DIM) for _ in range(2)))


@pytest.mark.parametrize("page_size", [1, 4])
def test_attention_output_equals_the_dense_reference_and_sglangs_torch_backend(page_size):
    world = AttentionWorld(page_size, seed=10 + page_size)
    world.add_requests([0, 7, 3])
    ours, sglang_native = KvplugAttnBackend(world.runner, "torch"), TorchNativeAttnBackend(world.runner)
    for mode, extend in STEPS:
        batch = world.forward_batch(mode, extend)
        lens = [(world.lens[request] - count, world.lens[request]) for request, count in extend.items()]
        ours.init_forward_metadata(batch)
        sglang_native.init_forward_metadata(batch)
        n = len(batch.out_cache_loc)
        for layer in world.layers:
            q, k, v = world.random(n, Q_HEADS * HEAD_DIM), world.random(n, KV_HEADS, HEAD_DIM), world.random(n, KV_HEADS, HEAD_DIM)
            out = ours.forward(q, k, v, layer, batch)  # SGLang's AttentionBackend.forward dispatch
            # the new K/V went to SGLang's out_cache_loc, readable through SGLang's pool API
            assert torch.equal(world.kv.get_key_buffer(layer.layer_id)[batch.out_cache_loc], k)
            assert torch.equal(world.kv.get_value_buffer(layer.layer_id)[batch.out_cache_loc], v)
            world.append_dense(extend, layer.layer_id, k, v)
            dense_k = [world.dense[(request, layer.layer_id)][0] for request in extend]
            dense_v = [world.dense[(request, layer.layer_id)][1] for request in extend]
            reference = dense_attention(q.view(n, Q_HEADS, HEAD_DIM), dense_k, dense_v, lens, HEAD_DIM**-0.5)
            assert out.shape == (n, Q_HEADS * HEAD_DIM)
            torch.testing.assert_close(out.double().view(n, Q_HEADS, HEAD_DIM), reference, rtol=1e-5, atol=1e-5)
            native = sglang_native.forward(q, k, v, layer, batch)
            torch.testing.assert_close(out, native, rtol=1e-5, atol=1e-5)


def test_attention_backend_refuses_what_it_cannot_compute():
    world = AttentionWorld(1, seed=3)
    world.add_requests([2])
    backend = KvplugAttnBackend(world.runner, "torch")
    batch = world.forward_batch(ForwardMode.EXTEND, {0: 2})
    backend.init_forward_metadata(batch)
    q, k = world.random(2, Q_HEADS * HEAD_DIM), world.random(2, KV_HEADS, HEAD_DIM)
    capped = RadixAttention(Q_HEADS, HEAD_DIM, 0.3, KV_HEADS, 0, logit_cap=30.0, sliding_window_size=16)
    with pytest.raises(NotImplementedError, match=r"logit capping \(30.0\), a sliding window \(16\)"):
        backend.forward(q, k, k, capped, batch)
    with pytest.raises(NotImplementedError, match="needs layer 0's own K/V"):
        backend.forward(q, None, None, world.layers[0], batch, save_kv_cache=False)
    with pytest.raises(NotImplementedError, match="not TARGET_VERIFY"):
        backend.init_forward_metadata(SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY))
    with pytest.raises(NotImplementedError, match="one token per request; SGLang asked for 16 tokens over 8 requests"):
        backend.init_cuda_graph_state(8, 16)  # a speculative-verify graph
    backend.init_cuda_graph_state(8, 8)
    with pytest.raises(NotImplementedError, match="EXTEND batches eagerly: only decode batches are captured"):
        backend.init_forward_metadata_out_graph(batch, in_capture=True)
    native_runner = SimpleNamespace(req_to_token_pool=make_pools(size=8, page_size=1, max_requests=2, max_context=8)[0],
                                    token_to_kv_pool=world.kv)
    with pytest.raises(ValueError, match="--kv-backend kvplug"):
        KvplugAttnBackend(native_runner, "torch")


def test_a_scale_other_than_the_default_gets_its_own_kvplug_backend():
    world = AttentionWorld(1, seed=4)
    world.add_requests([3])
    backend = KvplugAttnBackend(world.runner, "torch")
    batch = world.forward_batch(ForwardMode.EXTEND, {0: 2})
    backend.init_forward_metadata(batch)
    scaled = RadixAttention(Q_HEADS, HEAD_DIM, 0.05, KV_HEADS, 1)
    q, k, v = world.random(2, Q_HEADS * HEAD_DIM), world.random(2, KV_HEADS, HEAD_DIM), world.random(2, KV_HEADS, HEAD_DIM)
    out = backend.forward(q, k, v, scaled, batch)
    world.append_dense({0: 2}, 1, k, v)
    reference = dense_attention(q.view(2, Q_HEADS, HEAD_DIM), [world.dense[(0, 1)][0]], [world.dense[(0, 1)][1]], [(3, 5)], 0.05)
    torch.testing.assert_close(out.double().view(2, Q_HEADS, HEAD_DIM), reference, rtol=1e-5, atol=1e-5)
    assert len(backend._backends) == 1  # built lazily, for the one geometry used


# ============================================================================ pools and the configurator hooks


def configurator(attention_backend):
    server_args = SimpleNamespace(attention_backend=attention_backend, prefill_attention_backend=None, decode_attention_backend=None)
    model_config = SimpleNamespace(context_len=40, model_path="/models/ds", hf_config=SimpleNamespace(architectures=["DeepseekV3ForCausalLM"]))
    return SimpleNamespace(server_args=server_args, model_config=model_config, device="cpu")


def test_configurator_builds_kvplug_pools_only_for_kvplug_attention():
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    resolve, build_table = KVCacheConfigurator._resolve_kv_pool_class, KVCacheConfigurator._build_default_req_pool
    assert resolve(configurator("kvplug"), kind="mha", default=MHATokenToKVPool) is KvplugMHATokenToKVPool
    assert resolve(configurator("triton"), kind="mha", default=MHATokenToKVPool) is MHATokenToKVPool
    # SGLang resolves every kind for every model: resolving one the model does not use never fails
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    refused = resolve(configurator("kvplug:torch"), kind="mla", default=MLATokenToKVPool)
    assert issubclass(refused, MLATokenToKVPool) and refused is not MLATokenToKVPool
    assert resolve(configurator("triton"), kind="mla", default=MLATokenToKVPool) is MLATokenToKVPool
    # building it (a model that really needs it) is one clear error naming the model and what kvplug has
    with pytest.raises(UnsupportedKVPoolError, match=r"model '/models/ds' \(DeepseekV3ForCausalLM\): it needs SGLang's MLATokenToKVPool \('mla' KV pool\), and kvplug provides MHA/GQA"):
        refused(size=16, page_size=1, dtype=torch.float32, kv_lora_rank=8, qk_rope_head_dim=4, layer_num=1, device="cpu", enable_memory_saver=False)
    from sglang.srt.mem_cache.memory_pool import PageMajorMHATokenToKVPool

    page_major = resolve(configurator("kvplug"), kind="mha", default=PageMajorMHATokenToKVPool)
    assert issubclass(page_major, PageMajorMHATokenToKVPool) and page_major is not KvplugMHATokenToKVPool
    table = build_table(configurator("kvplug:torch"), max_num_reqs=3, extra_max_context_len=2)
    assert type(table) is KvplugReqToTokenPool and table.req_to_token.shape == (5, 42)
    assert type(build_table(configurator(None), max_num_reqs=3, extra_max_context_len=2)) is ReqToTokenPool


def test_kvplug_table_never_hands_out_its_dummy_row():
    table = KvplugReqToTokenPool(size=3, max_context_len=8, device="cpu", enable_memory_saver=False)
    assert table.dummy_row == 4 and table.available_size() == 3
    assert sorted(table.alloc_rows(3)) == [1, 2, 3] and table.alloc_rows(1) is None
    table.clear()
    assert sorted(table.free_slots) == [1, 2, 3]


def test_kvplug_kv_pool_is_sglangs_storage():
    pool = KvplugMHATokenToKVPool(size=12, page_size=4, dtype=torch.float16, head_num=2, head_dim=8, layer_num=3,
                                  device="cpu", enable_memory_saver=False)
    assert pool.kvplug_pool.num_pages == 3 and pool.kvplug_pool.page_size == 4
    k = torch.randn(3, 2, 8, dtype=torch.float16)
    pool.kvplug_pool.store_kv(k, -k, torch.tensor([0, 5, 15], dtype=torch.int32), 2)
    assert torch.equal(pool.get_key_buffer(2)[[0, 5, 15]], k) and torch.equal(pool.get_value_buffer(2)[[0, 5, 15]], -k)
    with pytest.raises(NotImplementedError, match="V head dim 4 != K head dim 8"):
        KvplugMHATokenToKVPool(size=8, page_size=1, dtype=torch.float16, head_num=2, head_dim=8, layer_num=1,
                               device="cpu", enable_memory_saver=False, v_head_dim=4)


# ============================================================================ more of the prefix-cache API


def kvplug_cache(name: str = "radix", page_size: int = 1, **params):
    table, allocator = make_pools(size=64, page_size=page_size, max_requests=4, max_context=64)
    return get_radix_cache_factory(names.radix_cache_backend_name(name))(
        build_context(cache_params(table, allocator, page_size, **params))
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"is_hybrid_swa": True}, "hybrid sliding-window attention"),
        ({"is_hybrid_ssm": True}, "Mamba"),
        ({"enable_hierarchical_cache": True}, "hierarchical cache"),
    ],
)
def test_the_factory_refuses_models_a_kvplug_cache_cannot_hold(flags, message):
    table, allocator = make_pools(size=8, page_size=1, max_requests=2, max_context=8)
    with pytest.raises(NotImplementedError, match=message):
        get_radix_cache_factory("kvplug:radix")(build_context(cache_params(table, allocator, 1), **flags))


def test_unsupported_cache_parameters_are_refused():
    with pytest.raises(ValueError, match="--radix-eviction-policy must be 'lru', got 'lfu'"):
        kvplug_cache(eviction_policy="lfu")
    with pytest.raises(NotImplementedError, match="EAGLE"):
        kvplug_cache(is_eagle=True)


@pytest.mark.parametrize("page_size", [1, 4])
def test_namespaces_and_lock_receipts_match_sglang(page_size):
    caches = [RadixCache(cache_params(*make_pools(size=64, page_size=page_size, max_requests=2, max_context=8), page_size)),
              kvplug_cache(page_size=page_size)]
    deltas, matched = [], []
    for cache in caches:
        tokens = array("q", range(1, 2 * page_size + 2))
        for extra_key, offset in ((None, 0), ("lora-a", 32)):
            values = torch.arange(offset, offset + len(tokens))
            cache.insert(InsertParams(key=RadixKey(tokens, extra_key), value=values))
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, "lora-a")))
        other = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, "lora-b")))
        matched.append((match.device_prefix_len, other.device_prefix_len, cache.path_device_indices(match.last_device_node).tolist()))
        lock = cache.lock(match.last_device_node)
        deltas.append((lock.receipt is not None, cache.evictable_size(), cache.protected_size()))
        cache.unlock(lock)
        deltas.append((cache.evictable_size(), cache.protected_size(), cache.total_size()))
    aligned = (2 * page_size + 1) // page_size * page_size
    assert matched[0] == matched[1] == (aligned, 0, list(range(32, 32 + aligned)))
    assert deltas[:2] == deltas[2:]


def test_disabled_cache_behaves_like_sglangs_disabled_radix_cache():
    caches = [RadixCache(cache_params(*make_pools(size=16, page_size=1, max_requests=2, max_context=8), 1, disable=True)),
              kvplug_cache(disable=True)]
    for cache in caches:
        assert cache.insert(InsertParams(key=RadixKey(array("q", [1, 2])), value=torch.tensor([3, 4]))).prefix_len == 0
        assert cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [1, 2])))).device_prefix_len == 0
        assert (cache.evictable_size(), cache.supports_prefix_sharing()) == (0, False)


def test_naive_cache_through_sglang_keeps_nothing_and_frees_everything():
    world = make_world("naive", page_size=1, size=32)
    for number in range(3):
        req = admit(world, f"n{number}", [1, 2, 3, 4, 5], [6, 7])
        assert req.prefix_len == 0
        checkpoint(world, f"n{number}")
        finish(world, f"n{number}")
        assert len(world.free_locations()) == 32 and world.cache.total_size() == 0
