"""A decode step's sampled ids are a ``PendingTokens`` object (issue 25): ``DecodeStep.commit``
makes it, the page table holds at most one (``defer_tokens``) and ``flush``, the one flush point,
takes it once - handing the ids to the next staging launch over the same cells, or writing them.
A second take, a take by another table, or a write handed to two tables raise
``DeferredWorkError`` and change nothing. The torch path a GPU table takes (``host_views=False``)
is checked against numpy host views, where a commit writes at once."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import kvplug
from kvplug.interface import DeferredWorkError
from kvplug.memory.page_table import PageTable
from kvplug.memory.pending_tokens import PendingTokens
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


def _table(host_views: bool = False) -> PageTable:
    return PageTable(3, 16, dummy_location=64, device=torch.device("cpu"), host_views=host_views)


def _pending(table: PageTable, cells: list[int], ids: list[int]) -> PendingTokens:
    flat = np.array(cells, dtype=np.int64)
    return PendingTokens(flat, torch.from_numpy(flat.copy()), torch.tensor(ids, dtype=torch.int32))


def test_a_commit_hands_one_object_to_the_table_and_the_next_step_takes_it_once(manager):
    backend = _backend_with_tables(manager, 1, host_views=False)
    a, b = _ready(backend, [[1, 2], [3, 4, 5]])
    step = backend.begin_decode([a, b])
    assert step.pending_tokens is None  # nothing committed yet
    step.commit(torch.tensor([21, 22], dtype=torch.int32))
    pending = step.pending_tokens
    assert isinstance(pending, PendingTokens) and backend.tables.pending_tokens is pending
    assert pending.owner is backend.tables and not pending.taken
    assert backend.tables._tokens[a.row, a.num_tokens - 1] != 21  # not written by the commit
    following = backend.begin_decode([a, b])
    assert pending.taken and backend.tables.pending_tokens is None
    assert following.input_ids.tolist() == [21, 22]  # the launch wrote and read them
    assert backend.token_pool[[a.row, b.row], [a.num_tokens - 1, b.num_tokens - 1]].tolist() == [21, 22]
    with pytest.raises(DeferredWorkError, match="written already"):
        pending.take(backend.tables)
    following.commit([31, 32])
    backend.check_integrity()


def test_a_second_take_or_another_tables_take_raises_and_writes_nothing():
    table, other = _table(), _table()
    pending = _pending(table, [5, 21], [7, 8])
    table.defer_tokens(pending)
    before = table._tokens.clone()
    with pytest.raises(DeferredWorkError, match="expected the pending token write of this table, got one this table"):
        pending.take(other)
    assert not pending.taken and table.pending_tokens is pending and torch.equal(table._tokens, before)
    with pytest.raises(DeferredWorkError, match="another table holds"):
        other.defer_tokens(pending)  # handed to two tables: refused, neither changed
    assert other.pending_tokens is None and table.pending_tokens is pending
    table.flush()
    assert table._tokens.view(-1)[[5, 21]].tolist() == [7, 8] and pending.taken
    after = table._tokens.clone()
    with pytest.raises(DeferredWorkError, match="written already"):
        pending.take(table)
    with pytest.raises(DeferredWorkError, match="written already"):
        table.defer_tokens(pending)
    assert table.pending_tokens is None and torch.equal(table._tokens, after)
    table.flush()
    assert torch.equal(table._tokens, after)


def test_the_flush_hands_the_ids_to_a_launch_only_over_exactly_their_cells():
    table = _table()
    table.defer_tokens(first := _pending(table, [5, 21], [7, 8]))
    assert table.flush(np.array([21, 5], dtype=np.int64)) is None  # other order: written here
    assert first.taken and table._tokens.view(-1)[[5, 21]].tolist() == [7, 8]
    table.defer_tokens(second := _pending(table, [6, 22], [9, 10]))
    tokens = table.flush(np.array([6, 22], dtype=np.int64))
    assert second.taken and tokens is second.values
    assert table._tokens.view(-1)[[6, 22]].tolist() == [0, 0]  # the launch writes them, not the flush


def test_two_commits_without_a_flush_between_leave_one_pending_write_and_the_older_written():
    table = _table()
    table.defer_tokens(older := _pending(table, [5], [7]))
    table.defer_tokens(newer := _pending(table, [21], [8]))
    assert older.taken and not newer.taken and table.pending_tokens is newer
    assert table._tokens.view(-1)[[5, 21]].tolist() == [7, 0]


def test_every_reader_of_the_device_token_pool_sees_the_pending_ids_first():
    """The readers go through the one flush point; a prompt written into a reused cell after a
    pending id is not overwritten by it."""
    table = _table()
    readers = [
        lambda: table.token_pool.view(-1)[5].item(),
        lambda: table.read_tokens(0, 5, 6).item(),
        lambda: table.gather_tokens([0], [5], [6]).item(),
        lambda: table.gather_tokens_at(torch.tensor([0]), torch.tensor([5])).item(),
    ]
    for value, read in enumerate(readers, start=11):
        table.defer_tokens(_pending(table, [5], [value]))
        assert read() == value and table.pending_tokens is None
    table.defer_tokens(_pending(table, [5], [40]))
    table.write_tokens(0, 5, np.array([41], dtype=np.int32))  # the row reused: the prompt comes after
    assert table.token_pool[0, 5].item() == 41
    table.defer_tokens(_pending(table, [5], [50]))
    table.write_flat(table._tokens, np.array([5], dtype=np.int64), torch.tensor([51], dtype=torch.int32))
    assert table.token_pool[0, 5].item() == 51


@pytest.mark.parametrize("seed", range(4))
def test_device_tables_hold_what_host_views_hold_over_random_steps(manager, seed):
    """Differential: the same random admissions, decode steps (subsets, repeated sets, direct
    reads), finishes and row reuse on both table kinds end with the same token pool each step."""
    rng = random.Random(seed)
    backends = [_backend_with_tables(manager, 4, host_views=views) for views in (True, False)]
    live: list[list] = [[], []]
    for _ in range(40):
        action = rng.random()
        if action < 0.2 and len(live[0]) < 5:
            prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
            sampled = rng.randrange(1, 50)
            for backend, requests in zip(backends, live):
                requests.extend(_ready(backend, [prompt], sampled=sampled))
        elif action < 0.3 and live[0]:
            i = rng.randrange(len(live[0]))
            for backend, requests in zip(backends, live):
                backend.finish(requests.pop(i), computed=True)
        elif live[0]:
            picked = sorted(rng.sample(range(len(live[0])), rng.randrange(1, len(live[0]) + 1)))
            if any(live[0][i].num_tokens + 2 > backends[0].max_seq_len for i in picked):
                continue
            ids = [rng.randrange(1, 50) for _ in picked]
            for backend, requests in zip(backends, live):
                step = backend.begin_decode([requests[i] for i in picked])
                step.commit(torch.tensor(ids, dtype=torch.int32))
        if rng.random() < 0.3:  # a reader between steps: the device-table backend writes its pending ids
            assert torch.equal(backends[0].token_pool, backends[1].token_pool)
    assert torch.equal(backends[0].token_pool, backends[1].token_pool)
    for backend in backends:
        backend.check_integrity()
