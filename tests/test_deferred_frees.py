"""The frees of a lazy region are a ``DeferredFrees`` the region owns (issue 25): ``FreeList.lazy``
opens it (nested regions share it), frees go into it, ``FreeList.apply`` releases it once at the
outermost exit. A second release, or frees the free list did not open, raise ``DeferredWorkError``
and change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplug.interface import DeferredWorkError
from kvplug.memory.allocator import FreeList, PagedAllocator
from kvplug.memory.deferred_frees import DeferredFrees
from kvplug.memory.page_table import PageTable

PAGE, PAGES = 4, 8


def _allocator() -> PagedAllocator:
    import kvplug

    table = PageTable(4, 64, dummy_location=PAGES * PAGE, device=torch.device("cpu"))
    cache = kvplug.create_prefix_cache("naive", page_size=PAGE)
    return PagedAllocator(PAGES, PAGE, table, cache)


def _finished_pair(allocator: PagedAllocator):
    a = allocator.open_request(0, torch.arange(8, dtype=torch.int32))
    b = allocator.open_request(1, torch.arange(8, dtype=torch.int32))
    allocator.allocate([a, b], [8, 8])
    return a, b


def test_the_region_object_collects_the_frees_and_the_outermost_exit_releases_it():
    allocator = _allocator()
    a, b = _finished_pair(allocator)
    free_list = allocator.free_list
    taken = sorted(allocator.page_table.host_table[a.row, 0:8:PAGE].tolist()
                   + allocator.page_table.host_table[b.row, 0:8:PAGE].tolist())
    assert free_list.deferred is None
    with allocator.lazy_free() as frees:
        assert isinstance(frees, DeferredFrees) and free_list.deferred is frees
        allocator.cache_request(a, finished=True)
        with allocator.lazy_free() as inner:
            assert inner is frees  # one region, one owner: the outermost
            allocator.cache_request(b, finished=True)
        assert not frees.taken and frees.num_pages == 4 and sorted(frees.pages().tolist()) == taken
        assert len(free_list) == 4  # not takeable yet
        allocator.check_integrity()  # but owned: by the region's object
    assert frees.taken and free_list.deferred is None and len(free_list) == PAGES
    assert sorted(free_list.snapshot().tolist()) == list(range(0, PAGES * PAGE, PAGE))
    allocator.check_integrity()


def test_an_exception_inside_the_region_still_releases_its_frees():
    allocator = _allocator()
    a, _ = _finished_pair(allocator)
    with pytest.raises(RuntimeError, match="inside"):
        with allocator.lazy_free() as frees:
            allocator.cache_request(a, finished=True)
            raise RuntimeError("inside the region")
    assert frees.taken and allocator.free_list.deferred is None and len(allocator.free_list) == 6
    allocator.check_integrity()


def test_frees_released_twice_raise_and_change_nothing():
    allocator = _allocator()
    a, _ = _finished_pair(allocator)
    with allocator.lazy_free() as frees:
        allocator.cache_request(a, finished=True)
    free_list = allocator.free_list
    before = free_list.snapshot().tolist()
    with pytest.raises(DeferredWorkError, match="released already"):
        free_list.apply(frees)
    with pytest.raises(DeferredWorkError, match="released already"):
        frees.take()
    with pytest.raises(DeferredWorkError, match="never reach the free list"):
        frees.add(np.array([0], dtype=np.int32))
    assert free_list.snapshot().tolist() == before
    allocator.check_integrity()


def test_frees_the_free_list_did_not_open_are_refused_and_the_region_stays_open():
    free_list = FreeList(PAGES, PAGE)
    first = free_list.take(2)
    with free_list.lazy() as frees:
        free_list.release(first)
        stranger = DeferredFrees()
        stranger.add(np.array([28], dtype=np.int32))
        with pytest.raises(DeferredWorkError, match="did not open"):
            free_list.apply(stranger)
        assert free_list.deferred is frees and frees.num_pages == 2 and len(free_list) == PAGES - 2
        assert not stranger.taken
    assert len(free_list) == PAGES and sorted(free_list.snapshot().tolist()) == list(range(0, PAGES * PAGE, PAGE))


def test_immediate_frees_bypass_the_region():
    free_list = FreeList(PAGES, PAGE)
    pages = free_list.take(3)
    with free_list.lazy() as frees:
        free_list.release(pages[:1], immediately=True)  # evicted pages, taken by the allocation that evicted them
        free_list.release(pages[1:])
        assert len(free_list) == PAGES - 2 and frees.num_pages == 2
        assert sorted(free_list.snapshot(include_pending=True).tolist()) == list(range(0, PAGES * PAGE, PAGE))
    assert len(free_list) == PAGES
