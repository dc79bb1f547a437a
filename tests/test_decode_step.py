"""``KVBackend.begin_decode`` / ``DecodeStep.commit``: the explicit decode step, on numpy host
tables and on the torch path a GPU table takes (where a commit's ids ride the next step's
staging launch), and what each call refuses with nothing changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvplug
from kvplug.decode_step import DecodeStep
from kvplug.interface import InvalidArgumentError, OutOfMemoryError
from tests.test_backend import _backend_with_tables


@pytest.fixture(scope="module")
def manager():
    return kvplug.PluginManager(entry_points=False)


def _ready(backend, prompts, sampled=9):
    requests = [backend.admit(prompt) for prompt in prompts]
    backend.allocate(requests)
    backend.prepare(requests, "prefill")
    backend.append_tokens(requests, [sampled] * len(requests))
    return requests


@pytest.mark.parametrize("host_views", [True, False])
def test_a_step_moves_lengths_by_one_and_its_commit_feeds_the_next(manager, host_views):
    backend = _backend_with_tables(manager, 4, host_views=host_views)
    requests = _ready(backend, [[1, 2, 3], [4, 5, 6, 7, 8]])
    before = [(r.cached_len, r.num_tokens) for r in requests]
    step = backend.begin_decode(requests)
    assert isinstance(step, DecodeStep) and step.num_live == 2 and step.graph_size is None
    assert step.input_ids.tolist() == [9, 9]
    rows = torch.tensor([r.row for r in requests])
    cached = torch.tensor([c for c, _ in before])
    assert torch.equal(step.out_loc, backend.page_table[rows, cached])
    assert step.positions.tolist() == cached.tolist()
    assert [r.device_len for r in requests] == [c + 1 for c, _ in before]
    step.commit(torch.tensor([11, 12], dtype=torch.int32))
    assert [(r.cached_len, r.num_tokens, r.device_len) for r in requests] == [(c + 1, n + 1, c + 1) for c, n in before]
    following = backend.begin_decode(requests)
    assert following.input_ids.tolist() == [11, 12]
    assert backend.token_pool[rows, cached + 1].tolist() == [11, 12]
    following.commit([21, 22])
    backend.check_integrity()


def test_a_commit_is_written_by_the_next_launch_or_by_any_other_reader_first(manager, monkeypatch):
    """Torch tables: a commit writes nothing itself; the next step over the same cells takes the
    ids in its staging launch (no token-pool write of its own); any other access of the token
    pool (a read, another batch, an admission reusing a row) writes them first."""
    backend = _backend_with_tables(manager, 1, host_views=False)
    a, b, c = _ready(backend, [[1, 2], [3, 4, 5], [6]])
    writes: list[str] = []
    tables = backend.tables
    original = tables.flush

    def counting_flush(decode_cells=None):
        pending = tables.pending_tokens
        tokens = original(decode_cells)
        if pending is not None:  # the one flush point took it: passed to the launch or written here
            assert pending.taken and tables.pending_tokens is None
            writes.append("launch" if tokens is not None else "settle")
        return tokens

    monkeypatch.setattr(tables, "flush", counting_flush)
    step = backend.begin_decode([a, b])
    step.commit(torch.tensor([21, 22], dtype=torch.int32))
    assert tables.pending_tokens is step.pending_tokens and not step.pending_tokens.taken and writes == []
    following = backend.begin_decode([a, b])  # the same cells: the launch writes and reads them
    assert following.input_ids.tolist() == [21, 22] and writes == ["launch"] and tables.pending_tokens is None
    assert step.pending_tokens.taken
    writes.clear()
    following.commit(torch.tensor([31, 32], dtype=torch.int32))
    # another request list: written first, then staged without them
    other = backend.begin_decode([b, c])
    assert writes == ["settle"] and other.input_ids.tolist() == [32, 9]
    assert backend.token_pool[a.row, a.num_tokens - 1] == 31
    other.commit([41, 42])
    # a finished request's row reused by an admission: the pending id goes in before the new prompt
    backend.finish(c, computed=True)
    d = backend.admit([7, 7, 7])
    assert d.row == c.row and writes == ["settle"]  # the admission only wrote the host arrays
    assert backend.token_pool[d.row, :3].tolist() == [7, 7, 7]  # the flush: pending id first, then the prompt
    assert writes == ["settle", "settle"]
    assert backend.token_pool[b.row, b.num_tokens - 1] == 41
    backend.check_integrity()


@pytest.mark.parametrize("host_views", [True, False])
def test_new_pages_are_written_by_the_step(manager, host_views):
    backend = _backend_with_tables(manager, 4, host_views=host_views)
    requests = _ready(backend, [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12]])  # next tokens start pages
    free_before = backend.allocator.num_free_pages
    pages = backend.allocator.free_page_starts[:2].tolist()
    step = backend.begin_decode(requests)
    assert backend.allocator.num_free_pages == free_before - 2
    assert step.out_loc.tolist() == pages
    for request, page in zip(requests, pages):
        assert backend.page_table[request.row, request.cached_len : request.cached_len + 4].tolist() == list(
            range(page, page + 4)
        )
        assert request.allocated_len == request.cached_len + 4
    step.commit([1, 2])
    step = backend.begin_decode(requests)  # inside the new pages: none taken
    assert backend.allocator.num_free_pages == free_before - 2
    step.commit([3, 4])
    backend.check_integrity()


def test_staged_pages_are_clipped_at_the_row_end():
    """The stager's torch path (the kernel's reference) writes a new page token by token from the
    request's cached length, stopping at the row's end (a page size that does not divide the
    row), and takes out_loc from the page; requests without a page read the table."""
    from kvplug.attention.decode_staging import DecodeStager
    from kvplug.memory.allocator import NewPages

    table = torch.arange(4 * 12, dtype=torch.int32).view(4, 12)
    stager = DecodeStager(table, torch.zeros_like(table), page_size=5, use_kernel=False)
    rows, cached = np.array([2, 0, 1]), np.array([10, 5, 3])
    batch = stager.stage(rows, cached, pages=NewPages(np.array([600, 700, -1], dtype=np.int32)))
    assert table[2, 10:].tolist() == [600, 601]  # clipped: the row ends after two cells
    assert table[0, 5:10].tolist() == [700, 701, 702, 703, 704] and table[0, 10:].tolist() == [10, 11]
    assert table[1].tolist() == list(range(12, 24))  # no page: untouched
    assert batch.out_loc.tolist() == [600, 700, 15]


@pytest.mark.parametrize("host_views", [True, False])
def test_what_begin_decode_refuses_leaves_everything_unchanged(manager, host_views):
    backend = _backend_with_tables(manager, 4, host_views=host_views, num_pages=4)
    (a,) = _ready(backend, [[1, 2, 3, 4, 5, 6, 7]])  # 8 tokens known, 7 cached: 2 pages
    b = backend.admit([1, 2, 3])  # not prefilled
    snapshot = (backend.page_table.clone(), backend.token_pool.clone(), backend.stats())
    for requests, error, match in (
        ([], InvalidArgumentError, "at least one request"),
        (None, InvalidArgumentError, "list of kvplug Requests"),
        ([a, a], InvalidArgumentError, "twice"),
        ([a, b], InvalidArgumentError, "exactly one known token"),
        (["x"], InvalidArgumentError, "kvplug Requests"),
    ):
        with pytest.raises(error, match=match):
            backend.begin_decode(requests)
    other = _backend_with_tables(manager, 4, host_views=host_views)
    with pytest.raises(InvalidArgumentError, match="not live"):
        other.begin_decode([a])
    assert torch.equal(backend.page_table, snapshot[0]) and torch.equal(backend.token_pool, snapshot[1])
    assert backend.stats() == snapshot[2]
    # out of pages: a's next token starts its third page while b and c hold the other two
    backend.allocate([b])
    step = backend.begin_decode([a])
    step.commit([5])
    assert (a.cached_len, a.allocated_len) == (8, 8)
    c = backend.admit([9, 9, 9])
    backend.allocate([c])  # the last free page
    free, lengths = backend.allocator.num_free_pages, a.lengths()
    with pytest.raises(OutOfMemoryError, match="needs 1 pages"):
        backend.begin_decode([a])
    assert backend.allocator.num_free_pages == free and a.lengths() == lengths
    backend.check_integrity()


def test_what_commit_refuses(manager):
    backend = _backend_with_tables(manager, 1, host_views=False)
    a, b = _ready(backend, [[1, 2], [3, 4, 5]])
    step = backend.begin_decode([a, b])
    lengths = [a.lengths(), b.lengths()]
    for ids, match in (([1], "one token id per request"), ([1, -2], r"\[0, 2147483647\]"),
                       (torch.tensor([[1, 2]], dtype=torch.int32), "one token id per request|1-D integer tensor"),
                       ([1.5, 2], "flat list of ints")):
        with pytest.raises(InvalidArgumentError, match=match):
            step.commit(ids)
    assert [a.lengths(), b.lengths()] == lengths and not step.committed
    step.commit([7, 8])
    with pytest.raises(InvalidArgumentError, match="already committed"):
        step.commit([7, 8])
    step = backend.begin_decode([a, b])
    backend.finish(b, computed=True)
    with pytest.raises(InvalidArgumentError, match="finished or changed"):
        step.commit([1, 2])
    assert a.cached_len == lengths[0]["cached_len"] + 1
    backend.check_integrity()


@pytest.mark.parametrize("host_views", [True, False])
def test_commit_compares_cached_lengths_once_some_moved_since_staging(manager, host_views):
    """A commit reads the cached lengths only when a transition wrote some since its step was
    staged: a step whose requests moved on since (another step over them committed) is refused
    with nothing changed; one whose requests did not is committed although another's moved."""
    backend = _backend_with_tables(manager, 4, host_views=host_views)
    a, b, c = _ready(backend, [[1, 2], [3, 4, 5], [6]])
    first = backend.begin_decode([a, b])
    second = backend.begin_decode([a, b])  # the same requests, staged again before the commit
    first.commit([7, 8])
    lengths = [a.lengths(), b.lengths()]
    with pytest.raises(InvalidArgumentError, match="finished or changed"):
        second.commit([9, 10])
    assert [a.lengths(), b.lengths()] == lengths and not second.committed
    third = backend.begin_decode([a])
    backend.begin_decode([c]).commit([11])  # c moves on, a does not
    third.commit([12])
    assert a.cached_len == lengths[0]["cached_len"] + 1 and a.num_tokens == lengths[0]["num_tokens"] + 1
    assert backend.token_pool[a.row, a.cached_len].item() == 12
    backend.check_integrity()


@pytest.mark.parametrize("host_views", [True, False])
def test_a_request_reaching_max_seq_len_stores_no_token_and_is_refused_after(manager, host_views):
    backend = _backend_with_tables(manager, 16, host_views=host_views)  # max_seq_len 96
    full, short = _ready(backend, [list(range(94)), [1, 2]])  # 95 and 3 known tokens
    step = backend.begin_decode([full, short])
    step.commit([5, 6])
    assert (full.cached_len, full.num_tokens) == (95, 96) and backend.token_pool[full.row, 95] == 5
    step = backend.begin_decode([full, short])  # full's last token: its K/V, no room for another
    step.commit([7, 8])
    assert (full.cached_len, full.num_tokens) == (96, 96) and (short.cached_len, short.num_tokens) == (4, 5)
    assert backend.token_pool[short.row, 4] == 8
    assert short.row == full.row + 1  # the cell after full's row is short's first: untouched
    assert backend.token_pool[short.row, :5].tolist() == [1, 2, 9, 6, 8]
    with pytest.raises(InvalidArgumentError, match="max_seq_len=96 tokens; finish it"):
        backend.begin_decode([full, short])
    backend.finish(full)
    backend.begin_decode([short]).commit([9])
    backend.check_integrity()


def test_a_request_of_another_backend_is_refused_everywhere(manager):
    """Keys are unique in the process: a request of another backend in the same row, admitted as
    that backend's first request too, is not live here."""
    ours = _backend_with_tables(manager, 4, host_views=True)
    theirs = _backend_with_tables(manager, 4, host_views=True)
    (mine,) = _ready(ours, [[1, 2, 3]])
    (foreign,) = _ready(theirs, [[1, 2, 3]])
    assert mine.row == foreign.row
    for call in (lambda: ours.allocate([foreign]), lambda: ours.prepare([foreign], "decode"),
                 lambda: ours.begin_decode([foreign]), lambda: ours.append_tokens([foreign], [1]),
                 lambda: ours.finish(foreign), lambda: ours.cache_unfinished(foreign)):
        with pytest.raises(InvalidArgumentError, match="not live|not from this"):
            call()
    ours.begin_decode([mine]).commit([4])
    ours.check_integrity()
    theirs.check_integrity()


def test_a_pool_too_big_to_allocate_is_an_out_of_memory_error(manager):
    from kvplug.backend import ModelShape, create_backend

    shape = ModelShape(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    with pytest.raises(OutOfMemoryError, match="cannot allocate the KV pool"):
        create_backend(shape, num_pages=10**13, attention=None, manager=manager)


def test_a_batch_whose_request_was_finished_is_refused_before_it_writes(manager):
    """forward (and a graph replay) refuse a batch prepared before one of its requests was
    finished: that request's pages may already be another's. Admissions alone do not matter."""
    from tests.decode_world import make_world

    backend, model = make_world(attention="torch", page_size=4, device="cpu", manager=manager)
    a, b = (backend.admit(list(range(1, 9 + i))) for i in range(2))
    backend.allocate([a, b])
    batch = backend.prepare([a, b], "prefill")
    c = backend.admit([5, 6, 7])  # a request started: the batch's own requests are still live
    model(backend.input_ids(batch), batch)
    backend.append_tokens([a, b], [1, 2])
    step = backend.begin_decode([a, b])
    backend.finish(a, computed=False)
    d = backend.admit(list(range(20, 40)))  # may take a's pages
    backend.allocate([d])
    before = backend.pool.kv_buffer.clone()
    with pytest.raises(InvalidArgumentError, match="was finished after this batch was prepared"):
        model.step_forward(step)
    assert torch.equal(backend.pool.kv_buffer, before)
    other, other_model = make_world(attention="torch", page_size=4, device="cpu", manager=manager)
    theirs = other.admit([1, 2, 3])
    other.allocate([theirs])
    foreign = other.prepare([theirs], "prefill")
    with pytest.raises(InvalidArgumentError, match="prepared by another KVBackend"):
        model(other.input_ids(foreign), foreign)  # this model's layers call backend.forward
    graphs = backend.decode_graphs(model.step_forward, batch_sizes=[2])
    e = backend.admit([3, 4, 5])
    backend.allocate([e])
    prefill = backend.prepare([e], "prefill")
    model(backend.input_ids(prefill), prefill)
    backend.append_tokens([e], [7])
    staged = backend.begin_decode([b, e])
    backend.finish(b, computed=False)
    with pytest.raises(InvalidArgumentError, match="was finished after this batch was prepared"):
        graphs.run(staged)
    backend.finish(c)
    backend.check_integrity()


def test_a_kv_pool_too_big_to_allocate_is_an_out_of_memory_error(manager):
    from kvplug.interface import KVPoolConfig

    config = KVPoolConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_pages=10**13, page_size=1,
                          dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(OutOfMemoryError, match="cannot allocate the KV pool"):
        kvplug.create_kv_pool("mha", config, manager=manager)


@pytest.mark.parametrize("host_views", [True, False])
def test_negative_token_ids_are_refused_with_nothing_changed(manager, host_views):
    backend = _backend_with_tables(manager, 4, host_views=host_views)
    with pytest.raises(InvalidArgumentError, match=r"\[0, 2147483647\]"):
        backend.admit(torch.tensor([1, -5, 3], dtype=torch.int32))
    (request,) = _ready(backend, [[1, 2, 3]])
    lengths = request.lengths()
    step = backend.begin_decode([request])
    with pytest.raises(InvalidArgumentError, match=r"\[0, 2147483647\]"):
        step.commit(torch.tensor([-1], dtype=torch.int32))
    step.commit(torch.tensor([4], dtype=torch.int32))
    backend.allocate([request])
    backend.prepare([request], "decode")
    with pytest.raises(InvalidArgumentError, match=r"\[0, 2147483647\]"):
        backend.append_tokens([request], torch.tensor([-7], dtype=torch.int32))
    assert request.num_tokens == lengths["num_tokens"] + 1
    backend.check_integrity()
