"""``--attention-backend KVPLUG`` (``kvplug_vllm.attention_backend``) inside vLLM's CPU build.

Unit: the metadata builder and the impl's forward over KV views that vLLM's own
``allocate_kv_cache`` made (one buffer, LBNHC, random contents), against a dense float64 SDPA
reference that reads only the reference copy of each request's K/V, with vLLM's padding
(requests of query length 0 and ``seq_len`` 0 on the null block, tokens at ``PAD_SLOT_ID``).
End to end: ``LLM(...)`` on a tiny random model greedy-decodes the same token ids with kvplug
attention (``CPU_ATTN`` overridden) as with vLLM's native ``CPU_ATTN``, prefix caching on, with
repeated prompts (cached prefixes) and chunked prefill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")
backend_module = pytest.importorskip("kvplug_vllm.attention_backend")
registration = pytest.importorskip("kvplug_vllm.attention_registration")

from kvplug.interface import ForwardPhase, InvalidArgumentError  # noqa: E402
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID, PAD_SLOT_ID  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

KvplugAttentionImpl = backend_module.KvplugAttentionImpl
KvplugAttentionMetadataBuilder = backend_module.KvplugAttentionMetadataBuilder

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE = 2, 24, 16
Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
MAX_BLOCKS_PER_REQ = 8


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import VllmConfig

    return VllmConfig()


def allocate_views(layout: KVCacheLayout, names: list[str]) -> tuple[FullAttentionSpec, list[torch.Tensor]]:
    """Per-layer KV views exactly as vLLM's worker allocates them (one int8 buffer)."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    page = spec.page_size_bytes
    layered = layout.is_layer_compact
    tensor = KVCacheTensor(
        size=len(names) * NUM_BLOCKS * page,
        layers=names,
        layer_stride=NUM_BLOCKS * page if layered else page,
        block_stride=page if layered else len(names) * page,
    )
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )
    caches = allocate_kv_cache(config, torch.device("cpu"), layout)
    return spec, [caches[name] for name in names]


class Step:
    """One random step: requests ``(cached_len, query_len)``, then padding requests and tokens."""

    def __init__(self, lens, pad_reqs: int, pad_tokens: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.lens = lens
        live = len(lens)
        num_reqs = live + pad_reqs
        self.block_table = torch.full((num_reqs, MAX_BLOCKS_PER_REQ), NULL_BLOCK_ID, dtype=torch.int32)
        free = rng.permutation(np.arange(1, NUM_BLOCKS))  # block 0 is vLLM's null block
        used = 0
        for i, (cached, query) in enumerate(lens):
            blocks = -(-(cached + query) // BLOCK_SIZE)
            self.block_table[i, :blocks] = torch.from_numpy(free[used : used + blocks].astype(np.int32))
            used += blocks
        query_lens = [query for _, query in lens] + [0] * pad_reqs
        self.query_start_loc = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
        self.seq_lens = torch.tensor([cached + query for cached, query in lens] + [0] * pad_reqs, dtype=torch.int32)
        slots = []
        for i, (cached, query) in enumerate(lens):
            for position in range(cached, cached + query):
                slots.append(int(self.block_table[i, position // BLOCK_SIZE]) * BLOCK_SIZE + position % BLOCK_SIZE)
        self.live_tokens = len(slots)
        self.slot_mapping = torch.tensor(slots + [PAD_SLOT_ID] * pad_tokens, dtype=torch.int64)
        self.num_tokens = self.live_tokens + pad_tokens
        generator = torch.Generator().manual_seed(seed)
        self.q = torch.randn(self.num_tokens, Q_HEADS, HEAD_DIM, generator=generator)
        self.k = torch.randn(self.num_tokens, KV_HEADS, HEAD_DIM, generator=generator)
        self.v = torch.randn(self.num_tokens, KV_HEADS, HEAD_DIM, generator=generator)

    def metadata(self) -> CommonAttentionMetadata:
        num_reqs = self.seq_lens.shape[0]
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc.clone(),
            query_start_loc_cpu=self.query_start_loc.clone(),
            seq_lens=self.seq_lens.clone(),
            seq_lens_cpu_upper_bound=self.seq_lens.clone(),
            num_reqs=num_reqs,
            num_actual_tokens=self.num_tokens,
            max_query_len=int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max()),
            max_seq_len=int(self.seq_lens.max()),
            block_table_tensor=self.block_table.clone(),
            slot_mapping=self.slot_mapping.clone(),
        )

    def reference(self, kv: torch.Tensor, scale: float) -> torch.Tensor:
        """Dense attention of the live tokens, float64, from ``kv`` (the cache before the step)
        for cached positions and the step's own K/V for new ones."""
        nhd = kv.transpose(1, 2).double()  # [B, N, H, 2D]
        out = []
        start = 0
        for i, (cached, query) in enumerate(self.lens):
            total = cached + query
            positions = torch.arange(total)
            blocks = self.block_table[i, positions // BLOCK_SIZE].long()
            rows = nhd[blocks, positions % BLOCK_SIZE]  # [total, H, 2D]
            keys, values = rows[..., :HEAD_DIM].clone(), rows[..., HEAD_DIM:].clone()
            keys[cached:] = self.k[start : start + query].double()
            values[cached:] = self.v[start : start + query].double()
            group = Q_HEADS // KV_HEADS
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            queries = self.q[start : start + query].double()
            scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
            mask = positions[None, :] > torch.arange(cached, total)[:, None]
            scores = scores.masked_fill(mask[None], float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values))
            start += query
        return torch.cat(out)


def make_group(vllm_config, layout=KVCacheLayout.LBNHC, **impl_options):
    names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    spec, views = allocate_views(layout, names)
    generator = torch.Generator().manual_seed(7)
    for view in views:
        view.copy_(torch.randn(view.shape, generator=generator))
    scale = HEAD_DIM**-0.5
    context = vllm_config.compilation_config.static_forward_context
    context.clear()
    layers = []
    for name, view in zip(names, views):
        impl = KvplugAttentionImpl(Q_HEADS, HEAD_DIM, scale, KV_HEADS, None, None, "auto", None,
                                   AttentionType.DECODER, None, **impl_options)
        layer = types.SimpleNamespace(layer_name=name, impl=impl, kv_cache=view)
        context[name] = layer
        layers.append(layer)
    builder = KvplugAttentionMetadataBuilder(spec, names, vllm_config, torch.device("cpu"))
    return builder, layers, scale


STEPS = {
    "prefill": ([(0, 37), (0, 5)], 0, 0),
    "extend-after-cached-prefix": ([(19, 14), (32, 1), (0, 20)], 0, 0),
    "decode-padded": ([(40, 1), (3, 1), (16, 1)], 2, 2),
    "mixed-padded-tokens": ([(5, 1), (0, 23), (17, 9)], 1, 3),
    "decode-block-boundaries": ([(15, 1), (16, 1), (31, 1), (47, 1)], 0, 0),
}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_forward_matches_dense_reference_and_writes_only_its_slots(vllm_config, name):
    lens, pad_reqs, pad_tokens = STEPS[name]
    builder, layers, scale = make_group(vllm_config)
    step = Step(lens, pad_reqs, pad_tokens, seed=len(name))
    metadata = builder.build(0, step.metadata())
    expected_phase = ForwardPhase.DECODE if all(query == 1 for _, query in lens) else ForwardPhase.PREFILL
    for (_, batch) in metadata.plans.values():
        assert batch.phase is expected_phase
        assert batch.batch_size == len(lens) + pad_tokens and batch.num_padded == pad_tokens
        # kvplug's out_loc is vLLM's slot mapping, with PAD_SLOT_ID on the null block's slot 0
        assert batch.out_loc.tolist() == step.slot_mapping.clamp(min=0).tolist()
        # ... and, for the live tokens, the token table's cell of each new token
        table = batch.page_table
        for i, (cached, query) in enumerate(lens):
            start = int(step.query_start_loc[i])
            assert table[i, cached : cached + query].tolist() == batch.out_loc[start : start + query].tolist()
        assert (table[-1] == 0).all(), "the dummy row points at the null block"
    for layer_id, layer in enumerate(layers):
        before = layer.kv_cache.clone()
        output = torch.full((step.num_tokens + 3, Q_HEADS, HEAD_DIM), float("nan"))  # vLLM pads q beyond the step
        q, k, v = (torch.cat([x, torch.zeros(3, *x.shape[1:])]) for x in (step.q, step.k, step.v))
        layer.impl.forward(layer, q, k, v, layer.kv_cache, metadata, output)
        expected = step.reference(before, scale)
        torch.testing.assert_close(output[: step.live_tokens].double(), expected, rtol=1e-5, atol=1e-5)
        assert torch.isfinite(output[: step.num_tokens]).all(), "padding tokens attend the null block: finite"
        after = layer.kv_cache.transpose(1, 2).reshape(NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, 2 * HEAD_DIM)
        previous = before.transpose(1, 2).reshape(NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, 2 * HEAD_DIM)
        slots = step.slot_mapping[: step.live_tokens]
        torch.testing.assert_close(after[slots, :, :HEAD_DIM], step.k[: step.live_tokens], rtol=0, atol=0)
        torch.testing.assert_close(after[slots, :, HEAD_DIM:], step.v[: step.live_tokens], rtol=0, atol=0)
        untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
        untouched[slots] = False
        if pad_tokens:
            untouched[NULL_BLOCK_ID * BLOCK_SIZE] = False  # padding writes land on the null block only
        assert torch.equal(after[untouched], previous[untouched]), f"layer {layer_id} changed outside its slots"


def test_steps_reuse_the_fixed_buffers(vllm_config):
    """A captured graph reads the batch from fixed addresses: consecutive steps of one size share them."""
    builder, _, _ = make_group(vllm_config)
    first = builder.build(0, Step([(9, 1), (20, 1)], 1, 1, seed=1).metadata())
    second = builder.build(0, Step([(30, 1), (2, 1)], 1, 1, seed=2).metadata())
    (_, a), (_, b) = next(iter(first.plans.values())), next(iter(second.plans.values()))
    for field in ("table_rows", "cached_lens", "device_lens", "extend_start", "out_loc", "page_table"):
        assert getattr(a, field).data_ptr() == getattr(b, field).data_ptr(), field
    assert b.device_lens.tolist() == [31, 3, 1] and b.table_rows.tolist()[-1] == builder._table.dummy_row


def test_graph_capture_then_decode_steps_are_planned_into_the_graph_state(vllm_config, monkeypatch):
    """build_for_cudagraph_capture prepares every kvplug backend's graph state over vLLM's capture
    sizes; a later decode step of a captured size is planned for replay (the torch backend reads
    the captured width), other steps eagerly; only decode steps of prepared sizes are captured."""
    from kvplug.attention.torch_backend import TorchMetadata

    monkeypatch.setattr(vllm_config.compilation_config, "cudagraph_capture_sizes", [1, 2, 4])
    builder, layers, scale = make_group(vllm_config)
    width = MAX_BLOCKS_PER_REQ * BLOCK_SIZE
    captured = builder.build_for_cudagraph_capture(Step([(0, 1)] * 3, 1, 1, seed=4).metadata())
    assert builder._graph_sizes == (1, 2, 4)
    assert all(batch.metadata == TorchMetadata(True, width) for _, batch in captured.plans.values())
    step = Step([(40, 1), (3, 1), (17, 1)], 1, 1, seed=5)
    replayed = builder.build(0, step.metadata())
    assert all(batch.metadata.kv_len_bound == width for _, batch in replayed.plans.values())
    layer = layers[0]
    before = layer.kv_cache.clone()
    output = torch.empty(step.num_tokens, Q_HEADS, HEAD_DIM)
    layer.impl.forward(layer, step.q, step.k, step.v, layer.kv_cache, replayed, output)
    torch.testing.assert_close(output[: step.live_tokens].double(), step.reference(before, scale), rtol=1e-5, atol=1e-5)
    eager = builder.build(0, Step([(40, 1), (3, 1), (17, 1)], 0, 0, seed=6).metadata())  # 3: not captured
    assert all(batch.metadata.kv_len_bound == 41 for _, batch in eager.plans.values())
    with pytest.raises(backend_module.UnsupportedAttentionError, match="single-token decode"):
        builder.build_for_cudagraph_capture(Step([(0, 5)], 0, 0, seed=7).metadata())
    with pytest.raises(InvalidArgumentError, match=r"graph of 8 requests; KVPLUG prepared \[1, 2, 4\]"):
        builder.build_for_cudagraph_capture(Step([(0, 1)] * 8, 0, 0, seed=8).metadata())


def test_an_lbhnc_view_is_refused_naming_the_layout(vllm_config):
    with pytest.raises(InvalidArgumentError, match="LBNHC"):
        builder, _, _ = make_group(vllm_config, layout=KVCacheLayout.LBHNC)
        builder.build(0, Step([(0, 4)], 0, 0, seed=3).metadata())


def test_the_gpu_tests_rebuild_vllms_views_exactly():
    """tests/test_vllm_layout_gpu.py (no vLLM there) rebuilds these views and VllmKVViews' K/V."""
    from tests.test_vllm_layout_gpu import LayoutPool, vllm_layout_views

    names = [f"layer{i}" for i in range(NUM_LAYERS)]
    _, views = allocate_views(KVCacheLayout.LBNHC, names)
    mirrored = vllm_layout_views(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    ours, theirs = backend_module.VllmKVViews(views, HEAD_DIM), LayoutPool(mirrored, HEAD_DIM)
    for layer in range(NUM_LAYERS):
        assert (views[layer].shape, views[layer].stride()) == (mirrored[layer].shape, mirrored[layer].stride())
        assert views[layer].data_ptr() - views[0].data_ptr() == mirrored[layer].data_ptr() - mirrored[0].data_ptr()
        for get in ("k_cache", "v_cache"):
            a, b = getattr(ours, get)(layer), getattr(theirs, get)(layer)
            assert (a.shape, a.stride()) == (b.shape, b.stride())
            assert a.data_ptr() - views[0].data_ptr() == b.data_ptr() - mirrored[0].data_ptr()
    assert (ours.num_pages, ours.page_size, ours.dummy_location) == (theirs.num_pages, theirs.page_size, 0)


def test_a_drifted_vllm_fails_when_the_builder_is_built(vllm_config, monkeypatch):
    from vllm.v1.attention.backends import utils

    monkeypatch.setattr(utils, "PAD_SLOT_ID", -2)
    with pytest.raises(registration.UnsupportedVllmAttentionError, match=r"PAD_SLOT_ID \(read: .*\): value expected '-1', found '-2'"):
        make_group(vllm_config)


def test_live_requests_after_padding_are_refused():
    with pytest.raises(InvalidArgumentError, match="must follow its live ones"):
        backend_module.plan_step(np.array([0, 1, 1, 2]), np.array([5, 0, 6]), 2, dummy_row=8)


@pytest.mark.parametrize(
    "arguments, feature",
    [
        (dict(sliding_window=64), "sliding window"),
        (dict(alibi_slopes=[1.0] * Q_HEADS), "ALiBi"),
        (dict(logits_soft_cap=30.0), "soft-capping"),
        (dict(kv_sharing_target_layer_name="model.layers.0.self_attn.attn"), "KV sharing"),
        (dict(attn_type=AttentionType.ENCODER_ONLY), "encoder_only attention"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
        (dict(sinks=torch.zeros(Q_HEADS)), "sinks"),
    ],
)
def test_unsupported_layers_are_refused_at_build(arguments, feature):
    with pytest.raises(backend_module.UnsupportedAttentionError, match=feature):
        KvplugAttentionImpl(Q_HEADS, HEAD_DIM, 0.1, KV_HEADS, **arguments)


def test_warm_up_forward_without_metadata_leaves_the_output():
    impl = KvplugAttentionImpl(Q_HEADS, HEAD_DIM, 0.1, KV_HEADS)
    output = torch.zeros(2, Q_HEADS, HEAD_DIM)
    assert impl.forward(None, output, output, output, torch.empty(0), None, output) is output


# ------------------------------------------------------------------------------ registration
def test_register_attention_is_idempotent_and_the_cli_name_parses(monkeypatch):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    first = registration.register_attention(cpu_override=False)
    second = registration.register_attention(cpu_override=False)
    assert first == second == (True, False)
    assert AttentionBackendEnum["KVPLUG"].get_class() is backend_module.KvplugAttentionBackend
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    arguments = parser.parse_args(["--attention-backend", "KVPLUG"])
    assert EngineArgs.from_cli_args(arguments).attention_backend in ("KVPLUG", AttentionBackendEnum["KVPLUG"])


def test_cpu_override_is_opt_in_by_env(monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    native = AttentionBackendEnum.CPU_ATTN
    native.clear_override()
    try:
        assert registration.register_attention(env={}).cpu_override is False
        assert native.get_path().endswith("cpu_attn.CPUAttentionBackend")
        assert registration.register_attention(env={registration.ATTENTION_ENV: "0"}).cpu_override is False
        assert registration.register_attention(env={registration.ATTENTION_ENV: "1"}).cpu_override is True
        assert native.get_path() == registration.BACKEND_CLASS_PATH
        assert registration.register_attention(env={registration.ATTENTION_ENV: "1"}).cpu_override is True
    finally:
        native.clear_override()


def test_kernel_choice_and_bad_names(vllm_config, monkeypatch):
    monkeypatch.setattr(vllm_config, "kv_transfer_config", None)
    assert registration.kernel_name(vllm_config, env={}) == "auto"
    assert registration.kernel_name(vllm_config, env={registration.ATTENTION_ENV: "1"}) == "auto"
    assert registration.kernel_name(vllm_config, env={registration.ATTENTION_ENV: "torch"}) == "torch"
    transfer = types.SimpleNamespace(kv_connector_extra_config={"attention": "torch,torch"})
    monkeypatch.setattr(vllm_config, "kv_transfer_config", transfer)
    assert registration.kernel_name(vllm_config, env={}) == "torch,torch"
    transfer.kv_connector_extra_config = {"attention": "no-such-kernel"}
    with pytest.raises(InvalidArgumentError, match=r"unknown kvplug attention backend 'no-such-kernel'.*torch"):
        registration.kernel_name(vllm_config, env={})
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    AttentionBackendEnum.CPU_ATTN.clear_override()
    transfer.kv_connector_extra_config = {"attention": True}
    with pytest.raises(InvalidArgumentError, match="KVPLUG_VLLM_ATTENTION=1"):
        registration.check_attention_selection(vllm_config)


# ------------------------------------------------------------------------------ end to end
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "The quick brown fox jumps over the lazy dog. " * 3 + "Then it ran away.",  # cached prefix
    "A completely different prompt about paged attention kernels",
    "x" * 200,  # longer than the 64-token step: chunked prefill
    "The quick brown fox jumps over the lazy dog. " * 3,  # a full repeat
]


def build_tiny_model(directory: Path) -> Path:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from tests.sglang_models import EOS_TOKEN_ID, PAD_TOKEN_ID, VOCAB_SIZE, build_tokenizer

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, do_sample=False)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory


def run_llm(model: str) -> dict:
    """Greedy token ids of ``PROMPTS`` (in two batches) and the KVPLUG forward count; runs in a child."""
    from vllm import LLM, SamplingParams

    calls = {"forward": 0}
    original = KvplugAttentionImpl.forward

    def counting(self, *args, **kwargs):
        calls["forward"] += 1
        return original(self, *args, **kwargs)

    KvplugAttentionImpl.forward = counting  # test instrumentation of this child process only
    registration.register_attention()
    llm = LLM(
        model=model, dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
        enable_prefix_caching=True, enforce_eager=True, distributed_executor_backend="uni", seed=0,
        kv_cache_memory_bytes=16 << 20, disable_log_stats=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for chunk in (PROMPTS[:3], PROMPTS[3:]):  # the second batch hits prefixes cached by the first
        tokens += [list(out.outputs[0].token_ids) for out in llm.generate(chunk, params, use_tqdm=False)]
    hits = sum(metric.value for metric in llm.get_metrics() if metric.name == "vllm:prefix_cache_hits")
    return {"tokens": tokens, "kvplug_forwards": calls["forward"], "cpu_override": registration.cpu_override_active(),
            "prefix_cache_hits": hits}


def _start_child(model: Path, kvplug: bool) -> subprocess.Popen:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_PLUGINS="", OMP_NUM_THREADS="1")
    env.pop(registration.ATTENTION_ENV, None)
    if kvplug:
        env[registration.ATTENTION_ENV] = "1"
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "adapters" / "vllm"), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, __file__, str(model)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=root)


def _results(children: tuple[subprocess.Popen, ...]) -> list[dict]:
    """Each child's JSON line; every child is reaped whatever happens."""
    try:
        outputs = [child.communicate(timeout=600) for child in children]
    finally:
        for child in children:
            child.kill()
            child.wait()
    for child, (_, stderr) in zip(children, outputs):
        assert child.returncode == 0, stderr[-4000:]
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]


def test_llm_tokens_identical_to_native_cpu_attention(tmp_path):
    model = build_tiny_model(tmp_path / "tiny-llama-hd32")
    children = _start_child(model, kvplug=False), _start_child(model, kvplug=True)  # side by side: startup dominates
    native, kvplug = _results(children)
    assert native["kvplug_forwards"] == 0 and not native["cpu_override"]
    assert kvplug["cpu_override"] and kvplug["kvplug_forwards"] > 0, "KVPLUG attention did not run"
    assert len(kvplug["tokens"]) == len(PROMPTS) and all(len(ids) == 12 for ids in kvplug["tokens"])
    assert kvplug["tokens"] == native["tokens"]
    # the second batch attended over cached prefixes (KVPLUG's extend-after-prefix path)
    assert kvplug["prefix_cache_hits"] > 0 and kvplug["prefix_cache_hits"] == native["prefix_cache_hits"]


if __name__ == "__main__":
    print(json.dumps(run_llm(sys.argv[1])))
