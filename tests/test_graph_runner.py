"""CUDA-graph decode runner: batch-size lists, padding with the dummy request, and the runner's
whole replay path on CPU (where it re-executes the step instead of replaying a graph)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.attention_reference import make_decode_world, one_torch_thread, prefill_world  # noqa: F401 (autouse fixture)
from kvplug.attention import build_attention_batch
from kvplug.attention.graph_padding import default_batch_sizes, padded_decode_inputs, padded_size
from kvplug.attention.graph_runner import GraphRunner
from kvplug.interface import ForwardPhase, InvalidArgumentError


@pytest.mark.parametrize(
    "max_bs, expected",
    [(1, [1]), (3, [1, 2, 3]), (5, [1, 2, 4, 5]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
     (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64])],
)
def test_default_batch_sizes(max_bs, expected):
    assert default_batch_sizes(max_bs) == expected


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_default_batch_sizes_rejects_non_positive(bad):
    with pytest.raises(InvalidArgumentError, match="positive int"):
        default_batch_sizes(bad)


def test_padded_size_picks_the_next_captured():
    captured = [1, 2, 4, 8, 16]
    assert [padded_size(bs, captured) for bs in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    with pytest.raises(InvalidArgumentError, match="outside the captured sizes 1..16"):
        padded_size(17, captured)
    with pytest.raises(InvalidArgumentError, match="no CUDA graph is captured"):
        padded_size(1, [])


def test_padded_inputs_point_padding_at_the_dummy_row():
    packed = padded_decode_inputs(np.array([5, 2, 7]), np.array([10, 0, 31]), 8, dummy_row=9, row_width=64)
    rows, cached, device, start, positions, index = np.split(packed, [8, 16, 24, 33, 41])
    assert rows.tolist() == [5, 2, 7] + [9] * 5
    assert cached.tolist() == [10, 0, 31] + [0] * 5
    assert device.tolist() == [11, 1, 32] + [1] * 5
    assert start.tolist() == list(range(9))
    assert positions.tolist() == cached.tolist()
    assert index.tolist() == [5 * 64 + 10, 2 * 64, 7 * 64 + 31] + [9 * 64] * 5
    with pytest.raises(InvalidArgumentError, match="cannot pad 3 requests down to 2"):
        padded_decode_inputs(np.array([5, 2, 7]), np.array([1, 1, 1]), 2, dummy_row=9, row_width=64)


def _world(**overrides):
    args = dict(backend_name="torch", num_layers=3, page_size=4, max_reqs=12, max_seq_len=96, seed=1)
    args.update(overrides)
    return make_decode_world(**args)


def test_replay_equals_eager_for_random_decode_batches():
    """Two identical worlds: one steps eagerly, the other through the runner, same requests."""
    eager_world, graph_world = _world(), _world()
    rows = list(range(10))
    prompt = [5, 17, 30, 1, 64, 9, 40, 2, 12, 50]
    for pool, table, backend, model in (eager_world, graph_world):
        prefill_world(pool, table, backend, model, rows, prompt)
    _, _, graph_backend, graph_model = graph_world
    progress = []
    runner = GraphRunner(graph_backend, graph_world[1], graph_model, max_batch_size=8, max_seq_len=96,
                         progress=lambda *args: progress.append(args))
    runner.capture()
    assert progress == [(1, 4, 8), (2, 4, 4), (3, 4, 2), (4, 4, 1)]
    lengths = dict(zip(rows, prompt))
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        bs = int(torch.randint(1, 9, (1,), generator=gen))
        live = sorted(torch.randperm(10, generator=gen)[:bs].tolist())
        cached = [lengths[r] for r in live]
        _, table, backend, model = eager_world
        batch = build_attention_batch(table, live, cached, [c + 1 for c in cached], ForwardPhase.DECODE)
        assert runner.can_use_graph(batch)
        backend.prepare_metadata(batch)
        eager = model(batch)
        replayed = runner.replay(live, cached, [c + 1 for c in cached])
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
        for r in live:
            lengths[r] += 1
    # both worlds wrote the same K/V for every live request; only the graph one wrote the dummy page
    num_pages = eager_world[0].num_pages
    torch.testing.assert_close(
        graph_world[0].kv_buffer[:, :, :num_pages], eager_world[0].kv_buffer[:, :, :num_pages], rtol=1e-4, atol=1e-4
    )
    assert eager_world[0].kv_buffer[:, :, num_pages].abs().sum() == 0 < graph_world[0].kv_buffer[:, :, num_pages].abs().sum()


def test_padded_replays_touch_only_live_out_loc_and_the_dummy_page():
    pool, table, backend, model = _world()
    prefill_world(pool, table, backend, model, [0, 3, 6], [20, 33, 7])
    runner = GraphRunner(backend, table, model, max_batch_size=8, max_seq_len=96, batch_sizes=[8])
    runner.capture()
    before = pool.kv_buffer.clone()
    first = runner.replay([0, 3, 6], [20, 33, 7], [21, 34, 8]).clone()
    after_first = pool.kv_buffer.clone()
    for _ in range(3):  # any number of padded replays of the same step changes nothing further
        again = runner.replay([0, 3, 6], [20, 33, 7], [21, 34, 8])
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert torch.equal(pool.kv_buffer, after_first)
    # [2, layers, pages + 1, page_size, heads, dim] -> which token locations changed
    changed = (before != after_first).any(-1).any(-1).any(0).any(0).flatten().nonzero().flatten()
    live_locations = {int(table[0, 20]), int(table[3, 33]), int(table[6, 7])}
    dummy_page = set(range(pool.num_pages * pool.page_size, (pool.num_pages + 1) * pool.page_size))
    assert set(changed.tolist()) <= live_locations | dummy_page
    assert live_locations <= set(changed.tolist())  # the live requests' new K/V did land


def test_replay_errors():
    pool, table, backend, model = _world()
    runner = GraphRunner(backend, table, model, max_batch_size=4, max_seq_len=96)
    with pytest.raises(InvalidArgumentError, match="no CUDA graph is captured"):
        runner.replay([0], [3], [4])
    runner.capture()
    with pytest.raises(InvalidArgumentError, match="outside the captured sizes"):
        runner.replay(list(range(5)), [3] * 5, [4] * 5)
    with pytest.raises(InvalidArgumentError, match="exactly one token"):
        runner.replay([0, 1], [3, 3], [4, 6])
    with pytest.raises(InvalidArgumentError, match="row width 96"):
        runner.replay([0], [96], [97])
    prefill = build_attention_batch(table, [0], [0], [5], ForwardPhase.PREFILL)
    assert not runner.can_use_graph(prefill)
    big = build_attention_batch(table, list(range(5)), [1] * 5, [2] * 5, ForwardPhase.DECODE)
    assert not runner.can_use_graph(big)
    runner.teardown()
    small = build_attention_batch(table, [0], [1], [2], ForwardPhase.DECODE)
    assert not runner.can_use_graph(small)
    with pytest.raises(InvalidArgumentError, match="no CUDA graph is captured"):
        runner.replay([0], [1], [2])


def test_runner_arguments_are_checked():
    pool, table, backend, model = _world()
    with pytest.raises(InvalidArgumentError, match="max_seq_len"):
        GraphRunner(backend, table, model, max_batch_size=4, max_seq_len=10_000)
    with pytest.raises(InvalidArgumentError, match="request rows"):
        GraphRunner(backend, table, model, max_batch_size=64, max_seq_len=96)
    with pytest.raises(InvalidArgumentError, match="batch sizes"):
        GraphRunner(backend, table, model, max_batch_size=4, max_seq_len=96, batch_sizes=[2, 8])
