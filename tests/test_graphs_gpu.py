"""CUDA-graph decode on the GPU: replay equals eager, padded slots write only the dummy page, and a
28-layer model-shaped stack gives the same logits captured and eager. Skipped without CUDA."""

from __future__ import annotations


import pytest
import torch

from tests.attention_reference import importable, make_decode_world, prefill_world, relative_error, requires_cuda
from kvplug.attention import build_attention_batch
from kvplug.attention.graph_runner import GraphRunner
from kvplug.interface import ForwardPhase, InvalidArgumentError

pytestmark = [pytest.mark.gpu, requires_cuda]


BACKENDS = [
    pytest.param("triton", marks=pytest.mark.skipif(not importable("triton"), reason="needs triton")),
    pytest.param("flashinfer", marks=pytest.mark.skipif(not importable("flashinfer"), reason="needs flashinfer")),
    "torch",
]


# the FlashInfer modules these tests use: tensor-core decode (8 / 2 heads), CUDA-core decode
# (16 / 8 heads, the 28-layer stack) and the prefill that fills the pools, all bf16 / 128
FLASHINFER_GRAPH_MODULES = [
    (torch.bfloat16, 128, 4, "decode"),
    (torch.bfloat16, 128, 2, "decode"),
    (torch.bfloat16, 128, 2, "extend_with_prefix"),
]


@pytest.fixture(scope="module")
def flashinfer_graph_modules():
    """Builds them in one ninja run before the first FlashInfer test (see ``warm_up_flashinfer``)."""
    from tests.test_attention_gpu import log_warm_up, warm_up_flashinfer

    log_warm_up(warm_up_flashinfer(FLASHINFER_GRAPH_MODULES))


@pytest.fixture
def compiled(request, backend):
    if backend == "flashinfer":
        request.getfixturevalue("flashinfer_graph_modules")


def _worlds(backend, **overrides):
    args = dict(backend_name=backend, num_layers=4, page_size=16, max_reqs=40, max_seq_len=1024,
                num_qo_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, device="cuda", seed=5)
    args.update(overrides)
    return make_decode_world(**args), make_decode_world(**args)


def _run_steps(eager_world, graph_world, runner, rows, lengths, steps, gen, max_bs):
    """Random decode batches stepped eagerly in one world and replayed in the other."""
    _, table, backend, model = eager_world
    worst = 0.0
    for _ in range(steps):
        bs = int(torch.randint(1, max_bs + 1, (1,), generator=gen))
        live = sorted(torch.randperm(len(rows), generator=gen)[:bs].tolist())
        live_rows = [rows[i] for i in live]
        cached = [lengths[r] for r in live_rows]
        batch = build_attention_batch(table, live_rows, cached, [c + 1 for c in cached], ForwardPhase.DECODE)
        assert runner.can_use_graph(batch)
        backend.prepare_metadata(batch)
        eager = model(batch)
        replayed = runner.replay(live_rows, cached, [c + 1 for c in cached])
        worst = max(worst, relative_error(replayed, eager.double().cpu()))
        for r in live_rows:
            lengths[r] += 1
    return worst


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_equals_eager(backend, compiled):
    eager_world, graph_world = _worlds(backend)
    gen = torch.Generator().manual_seed(11)
    rows = list(range(24))
    prompt = torch.randint(1, 700, (24,), generator=gen).tolist()
    for world in (eager_world, graph_world):
        prefill_world(*world, rows, prompt)
    runner = GraphRunner(graph_world[2], graph_world[1], graph_world[3], max_batch_size=16, max_seq_len=1024)
    runner.capture()
    assert runner.batch_sizes == [1, 2, 4, 8, 16]
    worst = _run_steps(eager_world, graph_world, runner, rows, dict(zip(rows, prompt)), 12, gen, 16)
    assert worst < 2e-2, f"graph logits differ from eager by {worst:.2e}"
    num_pages = eager_world[0].num_pages
    kv_error = relative_error(graph_world[0].kv_buffer[:, :, :num_pages], eager_world[0].kv_buffer[:, :, :num_pages].double().cpu())
    assert kv_error < 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_replays_write_only_live_locations_and_the_dummy_page(backend, compiled):
    (pool, table, attention, model), _ = _worlds(backend)
    prefill_world(pool, table, attention, model, [0, 5, 9], [100, 333, 17])
    runner = GraphRunner(attention, table, model, max_batch_size=8, max_seq_len=1024)
    runner.capture()
    before = pool.kv_buffer.clone()
    first = runner.replay([0, 5, 9], [100, 333, 17], [101, 334, 18]).clone()  # bs 3 padded to 4
    after = pool.kv_buffer.clone()
    for _ in range(5):
        runner.replay([0, 5, 9], [100, 333, 17], [101, 334, 18])
        runner.replay([5], [333], [334])  # bs 1: no padding
    assert torch.equal(pool.kv_buffer, after), "repeating the same steps changed the pool"
    assert torch.equal(runner.replay([0, 5, 9], [100, 333, 17], [101, 334, 18]), first)
    changed = (before != after).any(-1).any(-1).any(0).any(0).flatten().nonzero().flatten().tolist()
    live = {int(table[0, 100]), int(table[5, 333]), int(table[9, 17])}
    dummy = set(range(pool.num_pages * pool.page_size, (pool.num_pages + 1) * pool.page_size))
    assert live <= set(changed) <= live | dummy


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_28_layer_stack_captured_equals_eager(backend, compiled):
    eager_world, graph_world = _worlds(backend, num_layers=28, num_qo_heads=16, num_kv_heads=8, max_reqs=16,
                                       max_seq_len=512, seed=28)
    rows = list(range(12))
    prompt = [3, 50, 129, 200, 7, 64, 300, 1, 90, 45, 111, 256]
    logits = [prefill_world(*world, rows, prompt) for world in (eager_world, graph_world)]
    assert relative_error(logits[0], logits[1].double().cpu()) < 1e-5  # identical worlds, identical prefill
    runner = GraphRunner(graph_world[2], graph_world[1], graph_world[3], max_batch_size=12, max_seq_len=512)
    runner.capture()
    worst = _run_steps(eager_world, graph_world, runner, rows, dict(zip(rows, prompt)), 8, torch.Generator().manual_seed(2), 12)
    assert worst < 3e-2, f"28-layer graph logits differ from eager by {worst:.2e}"


def test_flashinfer_replay_of_an_uncaptured_size_is_an_error():
    if not importable("flashinfer"):
        pytest.skip("needs flashinfer")
    (pool, table, attention, model), _ = _worlds("flashinfer")
    attention.init_capture_graph(1024, [1, 4])
    batch = build_attention_batch(table, [0, 1], [3, 3], [4, 4], ForwardPhase.DECODE)
    with pytest.raises(InvalidArgumentError, match="no CUDA-graph wrapper for batch size 2"):
        attention.prepare_for_replay(batch)
