"""SGLang decode CUDA-graph hooks of ``KvplugAttnBackend``, run eagerly on the CPU.

The hooks are driven as SGLang 0.5.23's ``DecodeCudaGraphRunner`` drives them, with SGLang's own
runner inputs (``tests/sglang_graph_world.py``): ``init_cuda_graph_state``, then per captured
size (largest first) ``init_forward_metadata_out_graph(capture batch, in_capture=True)`` and the
warm-up/capture forwards, then per replay SGLang's padded replay view and
``init_forward_metadata_out_graph(view)`` before the (here eager) forward. Each replay is
compared with the plain ``init_forward_metadata`` path on the same pool contents: the same batch
for the live requests, the same outputs, the same pool everywhere but the dummy location, which
the padded slots (and only they) wrote. ``test_sglang_graphs_gpu.py`` captures the same hooks in
real CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from tests.sglang_helpers import import_sglang

import_sglang()

from kvplug.interface import ForwardPhase  # noqa: E402
from kvplug_sglang.attention_backend import KvplugAttnBackend  # noqa: E402
from tests.sglang_graph_world import (  # noqa: E402
    HEAD_DIM,
    KV_HEADS,
    Q_HEADS,
    REPLICA_FIELDS,
    GraphWorld,
    RunnerInputs,
    replica_replay_view,
)

CAPTURED = [1, 2, 4, 8]  # kvplug's default_batch_sizes(8), which the backend uses outside a server
# live requests per decode step: sizes between the captured ones (padded), and equal to them
STEPS = [[0, 2, 4], [1, 3, 5, 6, 0], [6, 5, 4, 3, 2, 1, 0], [2], [4, 6], [0, 1, 2, 3, 4, 5], [3, 1, 5, 6]]
PREFIXES = [5, 17, 1, 30, 9, 16, 2]
BATCH_FIELDS = ("table_rows", "cached_lens", "device_lens", "positions", "out_loc")


def layer_inputs(world: GraphWorld, n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [
        (world.random(n, Q_HEADS * HEAD_DIM), world.random(n, KV_HEADS, HEAD_DIM), world.random(n, KV_HEADS, HEAD_DIM))
        for _ in world.layers
    ]


def run_layers(backend: KvplugAttnBackend, world: GraphWorld, forward_batch, inputs) -> list[torch.Tensor]:
    """The model's attention calls of one forward (SGLang's ``AttentionBackend.forward`` dispatch)."""
    return [backend.forward(q, k, v, layer, forward_batch) for layer, (q, k, v) in zip(world.layers, inputs)]


def assert_same_kv_but_dummy(world: GraphWorld, got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    keep = torch.ones(got[0].shape[0], dtype=torch.bool)
    keep[list(world.dummy_locations)] = False
    for layer_got, layer_expected in zip(got, expected):
        assert torch.equal(layer_got[keep], layer_expected[keep])


def assert_same_view(replica, view) -> None:
    for field in REPLICA_FIELDS:
        ours, sglangs = getattr(replica, field), getattr(view, field)
        if isinstance(sglangs, torch.Tensor):
            assert ours.data_ptr() == sglangs.data_ptr() and torch.equal(ours, sglangs), field
        else:
            assert ours == sglangs, field


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_graph_hooks_equal_the_eager_path_with_padded_slots_on_the_dummy_page(page_size):
    world = GraphWorld("cpu", page_size, torch.float32, PREFIXES, seed=page_size)
    graphs, eager = KvplugAttnBackend(world.runner, "torch"), KvplugAttnBackend(world.runner, "torch")
    max_bs = CAPTURED[-1]
    graphs.init_cuda_graph_state(max_bs, max_bs)
    assert graphs._graph_sizes == CAPTURED
    inputs = RunnerInputs("cpu", max_bs, graphs.get_cuda_graph_seq_len_fill_value())

    # capture, largest size first: every slot is kvplug's dummy request, which writes the dummy
    # location only (SGLang runs two warm-up forwards and the captured one)
    for bs in reversed(CAPTURED):
        capture = inputs.capture_batch(bs)
        graphs.init_forward_metadata_out_graph(capture, in_capture=True)
        batch = graphs.forward_metadata
        assert batch.table_rows.tolist() == [world.table.dummy_row] * bs
        assert (batch.cached_lens.tolist(), batch.device_lens.tolist(), batch.out_loc.tolist()) == ([0] * bs, [1] * bs, [0] * bs)
        before = world.kv_snapshot()
        for _ in range(3):
            graphs.init_forward_metadata_in_graph(capture)
            layer_inputs_ = layer_inputs(world, bs)
            outputs = run_layers(graphs, world, capture, layer_inputs_)
            assert all(out.shape == (bs, Q_HEADS * HEAD_DIM) and out.isfinite().all() for out in outputs)
        assert_same_kv_but_dummy(world, world.kv_snapshot(), before)
        assert any(torch.equal(world.kv.k_buffer[0][0], k) for k in layer_inputs_[0][1])  # the dummy location was written

    padded_steps = 0
    for requests in STEPS:
        step = world.decode_batch(requests)
        raw_bs = len(requests)
        bs = next(size for size in CAPTURED if size >= raw_bs)
        padded_steps += bs > raw_bs
        live_inputs = layer_inputs(world, raw_bs)
        before = world.kv_snapshot()

        eager.init_forward_metadata(step)
        expected_outputs = run_layers(eager, world, step, live_inputs)
        expected_batch, expected_kv = eager.forward_metadata, world.kv_snapshot()
        world.restore(before)

        view = inputs.replay_view(step, bs)
        assert view.num_padding == bs - raw_bs and view.req_pool_indices[raw_bs:].eq(0).all()  # SGLang's filler
        assert_same_view(replica_replay_view(step, inputs.buffers(), bs, inputs.fill), view)  # the GPU test's view
        graphs.init_forward_metadata_out_graph(view)
        graphs.init_forward_metadata_in_graph(view)
        batch = graphs.forward_metadata
        assert batch.phase is ForwardPhase.DECODE and batch.batch_size == bs and batch.num_padded == bs - raw_bs
        for field in BATCH_FIELDS:
            assert torch.equal(getattr(batch, field)[:raw_bs], getattr(expected_batch, field)), (requests, field)
        assert torch.equal(batch.device_lens_cpu[:raw_bs], expected_batch.device_lens_cpu)
        assert torch.equal(batch.cached_lens_cpu[:raw_bs], expected_batch.cached_lens_cpu)
        assert batch.out_loc[:raw_bs].tolist() == step.out_cache_loc.tolist()  # SGLang's own locations
        # SGLang's filler slots are kvplug's dummy request
        assert batch.table_rows[raw_bs:].tolist() == [world.table.dummy_row] * (bs - raw_bs)
        assert batch.device_lens[raw_bs:].tolist() == [1] * (bs - raw_bs)
        assert batch.out_loc[raw_bs:].tolist() == [0] * (bs - raw_bs)

        padded_inputs = [
            tuple(torch.cat([live, world.random(bs - raw_bs, *live.shape[1:])]) for live in layer)
            for layer in live_inputs
        ]
        outputs = run_layers(graphs, world, view, padded_inputs)
        for out, expected in zip(outputs, expected_outputs):
            torch.testing.assert_close(out[:raw_bs], expected, rtol=1e-6, atol=1e-6)
            assert out[raw_bs:].isfinite().all()
        assert_same_kv_but_dummy(world, world.kv_snapshot(), expected_kv)
        if bs > raw_bs:  # the dummy location holds a padded slot's K
            assert any(torch.equal(world.kv.k_buffer[0][0], k) for k in padded_inputs[0][1][raw_bs:])
    assert padded_steps >= 4


def test_a_graph_replay_plans_every_geometry_without_running_a_layer():
    """A replay runs no Python per layer: every kvplug backend is planned by the out-of-graph hook."""
    world = GraphWorld("cpu", 1, torch.float32, [3, 4], seed=5)
    graphs = KvplugAttnBackend(world.runner, "torch")
    graphs.init_cuda_graph_state(4, 4)
    inputs = RunnerInputs("cpu", 4, 1)
    capture = inputs.capture_batch(2)
    graphs.init_forward_metadata_out_graph(capture, in_capture=True)
    run_layers(graphs, world, capture, layer_inputs(world, 2))
    assert len(graphs._backends) == 1 and graphs._prepared  # built during the warm-up forward
    step = world.decode_batch([1])
    graphs.init_forward_metadata_out_graph(inputs.replay_view(step, 2))
    (planned,) = graphs._prepared.values()
    assert planned.metadata is not None and torch.equal(planned.table_rows, graphs.forward_metadata.table_rows)


def test_graph_hooks_refuse_what_they_cannot_run():
    world = GraphWorld("cpu", 1, torch.float32, [3], seed=6)
    graphs = KvplugAttnBackend(world.runner, "torch")
    inputs = RunnerInputs("cpu", 4, 1)
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        graphs.init_forward_metadata_out_graph(inputs.capture_batch(2), in_capture=True)
    graphs.init_cuda_graph_state(2, 2)
    with pytest.raises(Exception, match=r"graph batch size must lie in \[1, 2\], got 4"):
        graphs.init_forward_metadata_out_graph(inputs.capture_batch(4), in_capture=True)
    step = world.decode_batch([0])
    step.seq_lens_cpu[0] = 65  # past the table's row width (64): nothing is written
    before = graphs._graph_batches.rows.clone()
    with pytest.raises(Exception, match=r"1 <= seq_len <= row width 64, got seq_lens \[65\]"):
        graphs.init_forward_metadata_out_graph(inputs.replay_view(step, 2))
    assert torch.equal(graphs._graph_batches.rows, before)
