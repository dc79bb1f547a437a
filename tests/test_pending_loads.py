"""A host-tier hit's copies still in flight are a ``PendingLoads`` object (issue 25): the admission
(``PagedAllocator.open_request``) makes it, the allocator keeps it under the row, and exactly one
call takes it - the first forward over the row (``order_loads``), ``loads_ready`` finding it
complete, or the request's finish. A second take, or a take for another request, raises
``DeferredWorkError`` naming what was expected and given, with nothing ordered or dropped."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvplug.interface import DeferredWorkError
from kvplug.memory import allocator as allocator_module
from kvplug.memory.host_pool import HostKVPool
from kvplug.memory.pending_loads import PendingLoads
from tests.test_host_tier import DelayedCopy, InFlightWorld, _fingerprint_rows

PREFIX = list(range(1, 17))


def _world_with_a_host_prefix(monkeypatch, copies: list):
    """A backend whose tier holds ``PREFIX`` in host memory, and whose loads complete only when
    ordered (or synchronised): each started copy is appended to ``copies``."""
    world = InFlightWorld(4, num_pages=40, host_pages=30, seed=0)
    backend = world.backend
    first = backend.admit(PREFIX + [99])
    backend.allocate([first])
    world.rows[:, :, backend.page_table[first.row, :17].long()] = _fingerprint_rows(PREFIX + [99], 0, 17)
    backend.finish(first, computed=True)
    backend.evict_prefix_cache(16)
    assert backend.prefix_cache.host_size_info.total_size == 16

    def start(pool, host_pages, device_locations, *, wait=True):
        copy = DelayedCopy(pool, host_pages, device_locations, random.Random(0))
        copy.query = lambda: copy.performed  # complete only once ordered
        copies.append(copy)
        return copy

    monkeypatch.setattr(HostKVPool, "read", start)
    return world


def test_the_admission_makes_one_object_and_the_first_forward_takes_it_once(monkeypatch):
    copies: list = []
    world = _world_with_a_host_prefix(monkeypatch, copies)
    backend, allocator = world.backend, world.backend.allocator
    request = backend.admit(PREFIX + [98])
    pending = allocator.pending_loads(request)
    assert isinstance(pending, PendingLoads) and (pending.row, pending.key) == (request.row, request.key)
    assert [load.done for load in pending.loads] == copies and len(copies) == 1 and not pending.taken
    assert not backend.loads_ready(request) and allocator.pending_loads(request) is pending  # a poll takes nothing
    backend.allocate([request])
    backend.prepare([request], "prefill")  # the one taker here: ordered before the forward
    assert pending.taken and copies[0].performed and allocator.pending_loads(request) is None
    assert not allocator.has_pending_loads
    with pytest.raises(DeferredWorkError, match=rf"expected the pending loads of the request in row {request.row} "
                                                rf"\(key {request.key}\), got ones taken already"):
        pending.take(request.row, request.key)
    locations = backend.page_table[request.row, :16].long()
    assert torch.equal(world.rows[:, :, locations], _fingerprint_rows(PREFIX, 0, 16))
    backend.finish(request, computed=True)
    backend.check_integrity()


@pytest.mark.parametrize("taker", ["ready", "finish"])
def test_loads_found_complete_or_a_finish_take_them_instead(monkeypatch, taker):
    copies: list = []
    world = _world_with_a_host_prefix(monkeypatch, copies)
    backend, allocator = world.backend, world.backend.allocator
    request = backend.admit(PREFIX + [98])
    pending = allocator.pending_loads(request)
    if taker == "ready":
        copies[0].synchronize()  # completed behind the host's back
        assert backend.loads_ready(request)
        assert pending.taken and allocator.pending_loads(request) is None
        backend.allocate([request])
        backend.prepare([request], "prefill")  # nothing left to order
        backend.finish(request, computed=True)
    else:
        backend.finish(request)  # never ran: its pages go back, so the copy is ordered first
        assert pending.taken and copies[0].performed
    assert not allocator.has_pending_loads
    backend.check_integrity()


def test_a_take_for_another_request_raises_and_orders_nothing(monkeypatch):
    copies: list = []
    world = _world_with_a_host_prefix(monkeypatch, copies)
    backend, allocator = world.backend, world.backend.allocator
    request = backend.admit(PREFIX + [98])
    pending = allocator.pending_loads(request)
    with pytest.raises(DeferredWorkError, match=rf"expected the pending loads of the request in row {request.row} "
                                                rf"\(key {request.key + 1}\), got another request's"):
        pending.take(request.row, request.key + 1)
    assert not pending.taken
    # the allocator's own record naming an older request of the row (a bookkeeping slip) is
    # refused before anything of the batch is taken or ordered
    other = backend.admit([7, 7, 7])
    allocator._loads[other.row] = stale = PendingLoads(other.row, other.key - 1, pending.loads)
    rows = np.array([request.row, other.row], dtype=np.int64)
    with pytest.raises(DeferredWorkError, match=f"key {other.key}.*got another request's"):
        allocator.order_loads(rows)
    assert not pending.taken and not stale.taken and not copies[0].performed
    assert allocator.pending_loads(request) is pending and allocator.pending_loads(other) is stale
    del allocator._loads[other.row]
    allocator.order_loads(rows)
    assert pending.taken and copies[0].performed


@pytest.mark.parametrize("seed", range(3))
def test_every_admissions_loads_are_taken_exactly_once_over_random_operations(seed, monkeypatch):
    """Property over ``InFlightWorld``'s random admissions, forwards, polls and finishes: each
    ``PendingLoads`` is taken once (a second take would raise), every copy is done by the end."""
    made: list[PendingLoads] = []
    takes: dict[int, int] = {}

    class Counted(PendingLoads):
        __slots__ = ()

        def __init__(self, *args) -> None:
            super().__init__(*args)
            made.append(self)

        def take(self, row, key):
            loads = super().take(row, key)
            takes[id(self)] = takes.get(id(self), 0) + 1
            return loads

    monkeypatch.setattr(allocator_module, "PendingLoads", Counted)
    world = InFlightWorld(4, num_pages=40, host_pages=30, seed=seed)
    monkeypatch.setattr(HostKVPool, "read", lambda pool, *args, **options: world.start_load(pool, *args, **options))
    world.run(300)
    assert made and all(takes.get(id(pending)) == 1 for pending in made)
    assert all(copy.performed for copy in world.copies)
    assert not world.backend.allocator.has_pending_loads
