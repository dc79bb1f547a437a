"""``KVBackend.decode_graphs``: batch-size lists, padding with the dummy request, and the whole
capture / stage / replay path on the CPU (where it runs the captured function eagerly over the
same fixed, padded buffers)."""

from __future__ import annotations

import pytest

import kvplug
from kvplug.decode_step import default_batch_sizes, padded_size
from kvplug.interface import InvalidArgumentError
from tests.attention_reference import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.decode_world import make_world, run_scenario


@pytest.fixture(scope="module")
def manager():
    return kvplug.PluginManager(entry_points=False)


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


@pytest.mark.parametrize("page_size", [1, 4])
def test_graph_steps_equal_eager_steps(manager, page_size):
    """Random admissions (shared prefixes: radix hits), prefills, decode batches of every size
    (between capture sizes, above the largest) and finishes mid-batch: the graph world's logits
    equal the eager world's, and both stay consistent."""
    kwargs = dict(attention="torch", page_size=page_size, device="cpu", manager=manager, max_running_reqs=12)
    eager, graphed = make_world(**kwargs), make_world(**kwargs)
    progress = []
    graphs = graphed[0].decode_graphs(graphed[1].step_forward, max_batch_size=8,
                                      progress=lambda *args: progress.append(args))
    assert graphs.batch_sizes == [1, 2, 4, 8] and not graphs.uses_cuda_graphs
    assert progress == [(1, 4, 8), (2, 4, 4), (3, 4, 2), (4, 4, 1)]
    counters = run_scenario(eager, graphed, steps=60, seed=page_size, tolerance=1e-5, check_live_kv=True)
    assert counters["graph_steps"] > 20 and counters["eager_steps"] > 0
    assert any(live != size for live, size in counters["sizes"])  # padded steps ran
    assert graphed[0].stats().cache_hit_tokens > 0


def test_padded_slots_write_only_the_dummy_page(manager):
    backend, model = make_world(attention="torch", page_size=4, device="cpu", manager=manager)
    graphs = backend.decode_graphs(model.step_forward, batch_sizes=[8])
    requests = [backend.admit(list(range(3 + i, 20 + 2 * i))) for i in range(3)]
    backend.allocate(requests)
    batch = backend.prepare(requests, "prefill")
    model(backend.input_ids(batch), batch)
    backend.append_tokens(requests, [1, 2, 3])
    before = backend.pool.kv_buffer.clone()
    step = backend.begin_decode(requests)
    assert step.graph_size == 8 and step.batch.batch_size == 8 and step.batch.num_padded == 5
    dummy_row = backend.tables.dummy_row
    assert step.batch.table_rows.tolist()[3:] == [dummy_row] * 5 and step.positions.tolist()[3:] == [0] * 5
    out = graphs.run(step)
    assert out.shape[0] == 3
    # [2, layers, pages + 1, page_size, heads, dim] -> which token locations changed
    changed = set((before != backend.pool.kv_buffer).any(-1).any(-1).any(0).any(0).flatten().nonzero().flatten().tolist())
    live = {int(backend.page_table[r.row, r.cached_len]) for r in requests}
    dummy = set(range(backend.num_pages * backend.page_size, (backend.num_pages + 1) * backend.page_size))
    assert live <= changed <= live | dummy
    step.commit([4, 5, 6])
    backend.check_integrity()


def test_run_refuses_stale_or_foreign_steps(manager):
    backend, model = make_world(attention="torch", page_size=1, device="cpu", manager=manager)
    graphs = backend.decode_graphs(model.step_forward, batch_sizes=[2, 4])
    a, b, c = (backend.admit([1, 2, 3 + i]) for i in range(3))
    backend.allocate([a, b, c])
    batch = backend.prepare([a, b, c], "prefill")
    model(backend.input_ids(batch), batch)
    backend.append_tokens([a, b, c], [7, 8, 9])
    first = backend.begin_decode([a, b])
    second = backend.begin_decode([c])  # size 1 is not captured: padded to 2, the same buffers
    assert first.graph_size == second.graph_size == 2
    with pytest.raises(InvalidArgumentError, match="staged again"):
        graphs.run(first)
    graphs.run(second)
    second.commit([1])
    with pytest.raises(InvalidArgumentError, match="already committed"):
        graphs.run(second)
    other, _ = make_world(attention="torch", page_size=1, device="cpu", manager=manager)
    foreign = other.admit([1, 2])
    other.allocate([foreign])
    other.prepare([foreign], "prefill")
    other.append_tokens([foreign], [3])
    for not_ours in (other.begin_decode([foreign]), "step"):
        with pytest.raises(InvalidArgumentError, match="DecodeStep of this backend"):
            graphs.run(not_ours)
    graphs.release()
    assert backend.graphs is None
    step = backend.begin_decode([c])
    assert step.graph_size is None and graphs.run(step).shape[0] == 1  # eager: forward_fn over the step


def test_decode_graphs_arguments_are_checked(manager):
    backend, model = make_world(attention="torch", page_size=1, device="cpu", manager=manager, max_running_reqs=4)
    with pytest.raises(InvalidArgumentError, match="max_batch_size"):
        backend.decode_graphs(model.step_forward, max_batch_size=5)
    with pytest.raises(InvalidArgumentError, match="batch sizes"):
        backend.decode_graphs(model.step_forward, batch_sizes=[2, 8])
    with pytest.raises(InvalidArgumentError, match="callable"):
        backend.decode_graphs(None)
    memory_only = kvplug.create_backend(backend.shape, num_pages=4, attention=None, manager=manager)
    with pytest.raises(InvalidArgumentError, match="attention backend"):
        memory_only.decode_graphs(model.step_forward)
