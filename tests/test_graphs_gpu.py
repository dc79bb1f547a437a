"""CUDA-graph decode on the GPU through ``KVBackend.decode_graphs``: replays equal eager steps
(random batches between capture sizes, above them, requests finishing mid-batch, radix hits),
repeated padded replays leave the live K/V bit-identical and write only the dummy page, and a
28-layer model-shaped stack gives the same logits captured and eager. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from kvplug.attention import build_attention_batch
from kvplug.interface import ForwardPhase, InvalidArgumentError
from tests.attention_reference import importable, make_decode_world, requires_cuda
from tests.decode_world import make_world, run_scenario

pytestmark = [pytest.mark.gpu, requires_cuda]


BACKENDS = [
    pytest.param("triton", marks=pytest.mark.skipif(not importable("triton"), reason="needs triton")),
    pytest.param("flashinfer", marks=pytest.mark.skipif(not importable("flashinfer"), reason="needs flashinfer")),
    "torch",
    pytest.param("fa3", marks=pytest.mark.skipif(not importable("sgl_kernel"), reason="needs sgl-kernel (the fa3 "
                 "backend; scripts/device-fa3.sh brings it to the GPU machine)")),
]


# the FlashInfer modules these tests use: tensor-core decode (8 / 2 heads), CUDA-core decode
# (16 / 8 heads, the 28-layer stack) and the prefill that fills the pools, all bf16 / 128
FLASHINFER_GRAPH_MODULES = [
    (torch.bfloat16, 128, 4, "decode"),
    (torch.bfloat16, 128, 2, "decode"),
    (torch.bfloat16, 128, 4, "extend_with_prefix"),
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
    args = dict(attention=backend, page_size=16, device="cuda", dtype=torch.bfloat16, num_layers=4, num_qo_heads=8,
                num_kv_heads=2, head_dim=128, max_running_reqs=24, max_seq_len=512, seed=5)
    args.update(overrides)
    return make_world(**args), make_world(**args)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_steps_equal_eager_steps(backend, page_size, compiled):
    eager, graphed = _worlds(backend, page_size=page_size)
    graphs = graphed[0].decode_graphs(graphed[1].step_forward, max_batch_size=8)  # bigger steps stay eager
    assert graphs.uses_cuda_graphs and graphs.batch_sizes == [1, 2, 4, 8]
    counters = run_scenario(eager, graphed, steps=40, seed=page_size, tolerance=2e-2, check_live_kv=True)
    print(f"{backend} page {page_size}: {counters['graph_steps']} replays, {counters['eager_steps']} eager, "
          f"worst relative error {counters['worst']:.2e}")
    assert counters["graph_steps"] > 10 and counters["eager_steps"] > 0
    assert any(live != size for live, size in counters["sizes"])
    assert graphed[0].stats().cache_hit_tokens > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_replays_write_only_live_locations_and_the_dummy_page(backend, compiled):
    (attention_backend, model), _ = _worlds(backend)
    graphs = attention_backend.decode_graphs(model.step_forward, max_batch_size=8)
    requests = [attention_backend.admit(torch.randint(0, 500, (n,)).tolist()) for n in (100, 333, 17)]
    attention_backend.allocate(requests)
    batch = attention_backend.prepare(requests, "prefill")
    model(attention_backend.input_ids(batch), batch)
    attention_backend.append_tokens(requests, [1, 2, 3])
    before = attention_backend.pool.kv_buffer.clone()
    step = attention_backend.begin_decode(requests)  # bs 3 padded to 4
    assert step.graph_size == 4
    first = graphs.run(step).clone()
    after = attention_backend.pool.kv_buffer.clone()
    for _ in range(5):
        again = graphs.run(step)
    assert torch.equal(attention_backend.pool.kv_buffer, after), "repeating the same replay changed the pool"
    assert torch.equal(again, first)
    changed = set((before != after).any(-1).any(-1).any(0).any(0).flatten().nonzero().flatten().tolist())
    table = attention_backend.page_table
    live = {int(table[r.row, r.cached_len]) for r in requests}
    pool = attention_backend.pool
    dummy = set(range(pool.num_pages * pool.page_size, (pool.num_pages + 1) * pool.page_size))
    assert live <= changed <= live | dummy
    step.commit(torch.tensor([4, 5, 6], dtype=torch.int32, device="cuda"))
    attention_backend.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_28_layer_stack_captured_equals_eager(backend, compiled):
    eager, graphed = _worlds(backend, num_layers=28, num_qo_heads=16, num_kv_heads=8, max_running_reqs=16,
                             max_seq_len=512, seed=28)
    graphed[0].decode_graphs(graphed[1].step_forward, max_batch_size=12)
    counters = run_scenario(eager, graphed, steps=16, seed=2, tolerance=3e-2)
    assert counters["graph_steps"] > 4


def test_flashinfer_replay_of_an_uncaptured_size_is_an_error():
    if not importable("flashinfer"):
        pytest.skip("needs flashinfer")
    pool, table, attention, model = make_decode_world(
        backend_name="flashinfer", num_layers=4, page_size=16, max_reqs=40, max_seq_len=1024, num_qo_heads=8,
        num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, device="cuda", seed=5)
    attention.init_capture_graph(1024, [1, 4])
    batch = build_attention_batch(table, [0, 1], [3, 3], [4, 4], ForwardPhase.DECODE)
    with pytest.raises(InvalidArgumentError, match="no CUDA-graph wrapper for batch size 2"):
        attention.prepare_for_replay(batch)
