"""The torch reference backend against the dense SDPA oracle (fp32, CPU), plus registration,
``auto``, hybrids and bad input. These run in CPU CI."""

from __future__ import annotations

import logging
import types

import pytest
import torch

import kvplug
from tests.attention_reference import (  # noqa: F401 (one_torch_thread: autouse fixture)
    one_torch_thread,
    SCENARIOS,
    case_reference,
    chunk_lens,
    dense_attention,
    make_case,
    relative_error,
    run_case,
)
from kvplug.attention import HybridAttentionBackend, TorchAttentionBackend, build_attention_batch
from kvplug.attention.auto import choose_backend_name
from kvplug.interface import AttentionConfig, ForwardPhase, InvalidArgumentError

FP32_BOUND = 1e-5


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_torch_backend_matches_dense_reference(scenario, page_size, group, head_dim):
    case = make_case(
        SCENARIOS[scenario], page_size=page_size, num_qo_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
        seed=page_size * 100 + group,
    )
    expected_pool = case.expected_pool()
    out = run_case("torch", case)
    assert relative_error(out, case_reference(case)) < FP32_BOUND
    # the step's K/V landed at out_loc and nothing else in the pool changed
    assert torch.equal(case.pool.kv_buffer, expected_pool)


def test_custom_scale_is_used():
    case = make_case(SCENARIOS["extend_with_prefix"], scale=0.3, num_qo_heads=4, num_kv_heads=2)
    out = run_case("torch", case)
    assert relative_error(out, case_reference(case)) < FP32_BOUND
    default = dense_attention(case.q, case.dense_k, case.dense_v, case.lens)  # scale 1/sqrt(d)
    assert relative_error(out, default) > 1e-2


@pytest.mark.parametrize("page_size, chunk", [(1, 64), (16, 48), (64, 100)])
def test_chunked_prefill_equals_one_shot(page_size, chunk):
    """Prefill two prompts chunk by chunk; the pool carries each chunk's K/V to the next."""
    totals = [300, 170]
    case = make_case([(0, t) for t in totals], page_size=page_size, num_qo_heads=8, num_kv_heads=2)
    backend = kvplug.create_attention_backend("torch", case.config())
    token_base = [0, totals[0]]
    outputs = torch.empty_like(case.q)
    chunks = [chunk_lens(t, chunk) for t in totals]
    for step in range(max(len(c) for c in chunks)):
        live = [i for i in range(len(totals)) if step < len(chunks[i])]
        lens = [chunks[i][step] for i in live]
        batch = build_attention_batch(
            case.page_table, [case.rows[i] for i in live], [c for c, _ in lens], [d for _, d in lens], ForwardPhase.PREFILL
        )
        index = torch.cat([torch.arange(token_base[i] + c, token_base[i] + d) for i, (c, d) in zip(live, lens)])
        backend.prepare_metadata(batch)
        out = backend.forward(case.q[index], case.k[index], case.v[index], case.layer_id, batch)
        outputs[index] = out.view(-1, *case.q.shape[1:])
    assert relative_error(outputs, case_reference(case)) < FP32_BOUND


def test_decode_with_capture_bound_equals_eager():
    """The capturable decode path (padded to max_seq_len) computes the same as the eager one."""
    lens = SCENARIOS["decode"]
    eager_case = make_case(lens, page_size=16, num_qo_heads=8, num_kv_heads=2, seed=7)
    eager = run_case("torch", eager_case)
    case = make_case(lens, page_size=16, num_qo_heads=8, num_kv_heads=2, seed=7)
    backend = kvplug.create_attention_backend("torch", case.config())
    backend.init_capture_graph(case.page_table.shape[1], [1, 2, 8])
    backend.prepare_for_capture(case.batch)
    assert case.batch.metadata.kv_len_bound == case.page_table.shape[1]
    captured = backend.forward(case.q, case.k, case.v, case.layer_id, case.batch).view(case.q.shape)
    torch.testing.assert_close(captured, eager, rtol=1e-5, atol=1e-5)


def test_capture_needs_init_and_decode():
    case = make_case(SCENARIOS["extend_with_prefix"])
    backend = kvplug.create_attention_backend("torch", case.config())
    with pytest.raises(InvalidArgumentError, match="init_capture_graph"):
        backend.prepare_for_capture(case.batch)
    backend.init_capture_graph(64, [1])
    with pytest.raises(InvalidArgumentError, match="only decode"):
        backend.prepare_for_capture(case.batch)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: {"q": c.q[:, :1]}, "q must be shape"),
        (lambda c: {"k": c.k.double()}, "k must be torch.float32"),
        (lambda c: {"v": c.v[:-1]}, "v must be shape"),
    ],
)
def test_bad_inputs_leave_the_pool_unchanged(mutate, message):
    case = make_case(SCENARIOS["extend_with_prefix"])
    backend = kvplug.create_attention_backend("torch", case.config())
    backend.prepare_metadata(case.batch)
    before = case.pool.kv_buffer.clone()
    args = {"q": case.q, "k": case.k, "v": case.v, **mutate(case)}
    with pytest.raises(InvalidArgumentError, match=message):
        backend.forward(args["q"], args["k"], args["v"], case.layer_id, case.batch)
    assert torch.equal(case.pool.kv_buffer, before)


def test_forward_before_prepare_metadata_is_an_error():
    case = make_case(SCENARIOS["decode"])
    backend = kvplug.create_attention_backend("torch", case.config())
    with pytest.raises(InvalidArgumentError, match="prepare_metadata"):
        backend.forward(case.q, case.k, case.v, case.layer_id, case.batch)


def test_config_must_match_pool():
    case = make_case(SCENARIOS["decode"], num_kv_heads=2)
    config = AttentionConfig(case.pool, case.page_table, num_qo_heads=8, num_kv_heads=4, head_dim=64)
    with pytest.raises(InvalidArgumentError, match="pool holds 2 KV heads"):
        TorchAttentionBackend(config)
    with pytest.raises(InvalidArgumentError, match="no options"):
        TorchAttentionBackend(case.config(block=1))


def test_builtin_names_are_registered():
    assert {"torch", "triton", "flashinfer", "fa3", "auto"} <= set(kvplug.available("attention"))


@pytest.mark.parametrize("name, module, extra", [("triton", "triton", "triton"), ("flashinfer", "flashinfer", "flashinfer"), ("fa3", "sgl_kernel", "fa3")])
def test_gpu_backends_refuse_clearly_on_this_machine(name, module, extra):
    """Missing library: an ImportError naming the extra. Library present: a CPU pool is refused."""
    case = make_case(SCENARIOS["decode"])
    try:
        __import__(module)
    except ImportError:
        with pytest.raises(ImportError, match=rf"pip install -e \"\.\[{extra}\]\""):
            kvplug.create_attention_backend(name, case.config())
    else:
        with pytest.raises(InvalidArgumentError, match="needs a cuda pool"):
            kvplug.create_attention_backend(name, case.config())


def test_auto_on_cpu_is_torch_and_logs_it(caplog):
    case = make_case(SCENARIOS["decode"])
    with caplog.at_level(logging.INFO, logger="kvplug.attention.auto"):
        backend = kvplug.create_attention_backend("auto", case.config())
    assert isinstance(backend, TorchAttentionBackend)
    assert "chose 'torch'" in caplog.text


@pytest.mark.parametrize(
    "present, expected",
    [({"flashinfer", "triton"}, "flashinfer"), ({"triton"}, "triton"), (set(), "torch")],
)
def test_auto_preference_order_on_cuda(present, expected):
    cuda_pool = types.SimpleNamespace(device=torch.device("cuda"))
    config = AttentionConfig(cuda_pool, torch.zeros(2, 32, dtype=torch.int32), 4, 2, 64)
    assert choose_backend_name(config, importable=lambda name: name in present) == expected


def test_hybrid_routes_by_phase():
    prefill_case = make_case(SCENARIOS["extend_with_prefix"], num_qo_heads=4, num_kv_heads=2)
    calls = []

    class Recording(TorchAttentionBackend):
        def prepare_metadata(self, batch):
            calls.append((self.role, batch.phase))
            super().prepare_metadata(batch)

    prefill, decode = Recording(prefill_case.config()), Recording(prefill_case.config())
    prefill.role, decode.role = "prefill", "decode"
    hybrid = HybridAttentionBackend(prefill, decode)
    hybrid.prepare_metadata(prefill_case.batch)
    out = hybrid.forward(prefill_case.q, prefill_case.k, prefill_case.v, prefill_case.layer_id, prefill_case.batch)
    assert relative_error(out, case_reference(prefill_case)) < FP32_BOUND
    decode_batch = build_attention_batch(prefill_case.page_table, prefill_case.rows[:1], [3], [4], ForwardPhase.DECODE)
    hybrid.prepare_metadata(decode_batch)
    assert calls == [("prefill", ForwardPhase.PREFILL), ("decode", ForwardPhase.DECODE)]


def test_hybrid_by_name_and_pool_check():
    case = make_case(SCENARIOS["mixed_short_long"], num_qo_heads=4, num_kv_heads=2)
    backend = kvplug.create_attention_backend("torch, torch", case.config())
    assert isinstance(backend, HybridAttentionBackend)
    backend.prepare_metadata(case.batch)
    out = backend.forward(case.q, case.k, case.v, case.layer_id, case.batch)
    assert relative_error(out, case_reference(case)) < FP32_BOUND
    other = make_case(SCENARIOS["decode"], num_qo_heads=4, num_kv_heads=2)
    with pytest.raises(InvalidArgumentError, match="share one KV pool"):
        HybridAttentionBackend(TorchAttentionBackend(case.config()), TorchAttentionBackend(other.config()))
