"""Paged allocator: exact table contents, eviction on shortage, atomic failure, cache_request
semantics, lazy frees and the integrity checker — against naive, a dict reference cache and radix."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import kvplug
from kvplug.interface import (
    BaseCacheHandle,
    BasePrefixCache,
    InsertResult,
    InvalidArgumentError,
    MatchResult,
    OutOfMemoryError,
    SizeInfo,
)
from kvplug.memory.allocator import PagedAllocator
from kvplug.memory.page_table import PageTable

# ---------------------------------------------------------------------- dict reference cache


@dataclass
class _Entry:
    locations: tuple[int, ...]
    locks: int
    last_used: int


class DictHandle(BaseCacheHandle):
    def __init__(self, cache: "DictPrefixCache", keys: list[tuple[int, ...]]) -> None:
        self.cache, self.keys = cache, keys
        self.cached_len = len(keys) * cache.page_size

    def get_matched_indices(self) -> torch.Tensor:
        values = [loc for key in self.keys for loc in self.cache.pages[key].locations]
        return torch.tensor(values, dtype=torch.int32)


class DictPrefixCache(BasePrefixCache):
    """Obviously-right prefix cache: one dict entry per cached page, keyed by all tokens up to
    the page's end; eviction scans for the least recently used unlocked leaf."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[tuple[int, ...], _Entry] = {}
        self.clock = 0
        self.evict_calls: list[int] = []

    def _page_keys(self, ids: list[int]) -> list[tuple[int, ...]]:
        return [tuple(ids[: (i + 1) * self.page_size]) for i in range(len(ids) // self.page_size)]

    def _touch(self, keys: list[tuple[int, ...]]) -> None:
        self.clock += 1
        for key in keys:
            self.pages[key].last_used = self.clock

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        keys = []
        for key in self._page_keys(input_ids.tolist()):
            if key not in self.pages:
                break
            keys.append(key)
        self._touch(keys)
        return MatchResult(DictHandle(self, keys))

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        for key in handle.keys:
            self.pages[key].locks += -1 if unlock else 1
            assert self.pages[key].locks >= 0

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        assert input_ids.shape == indices.shape and input_ids.shape[0] % self.page_size == 0
        locations, keys, cached = indices.tolist(), self._page_keys(input_ids.tolist()), 0
        for i, key in enumerate(keys):
            if key in self.pages:
                cached += self.page_size
            else:
                page = tuple(locations[i * self.page_size : (i + 1) * self.page_size])
                self.pages[key] = _Entry(page, 0, 0)
        self._touch(keys)
        return InsertResult(cached, DictHandle(self, keys))

    def evict(self, size: int) -> torch.Tensor:
        self.evict_calls.append(size)
        if size > self.size_info.evictable_size:
            raise InvalidArgumentError(f"cannot evict {size}")
        freed: list[int] = []
        while len(freed) < size:
            parents = {key[: -self.page_size] for key in self.pages}
            leaves = [key for key, entry in self.pages.items() if entry.locks == 0 and key not in parents]
            victim = min(leaves, key=lambda key: self.pages[key].last_used)
            freed.extend(self.pages.pop(victim).locations)
        return torch.tensor(freed, dtype=torch.int32)

    def reset(self) -> None:
        self.pages.clear()

    @property
    def size_info(self) -> SizeInfo:
        locked = sum(1 for entry in self.pages.values() if entry.locks)
        return SizeInfo((len(self.pages) - locked) * self.page_size, locked * self.page_size)

    def check_integrity(self) -> None:
        for key in self.pages:
            assert len(key) == self.page_size or key[: -self.page_size] in self.pages
        locations = self.all_locations()
        assert len(set(locations)) == len(locations)

    def all_locations(self) -> list[int]:
        return [loc for entry in self.pages.values() for loc in entry.locations]


# ---------------------------------------------------------------------- fixtures


def make_cache(kind: str, page_size: int) -> BasePrefixCache:
    if kind == "dict":
        return DictPrefixCache(page_size)
    if kind == "radix":
        pytest.importorskip("kvplug.prefix_cache.radix")
    return kvplug.create_prefix_cache(kind, page_size=page_size)


CACHES = ["naive", "dict", "radix"]
REUSING_CACHES = ["dict", "radix"]


def make_allocator(cache_kind="dict", page_size=4, num_pages=16, rows=4, max_seq_len=64) -> PagedAllocator:
    table = PageTable(rows, max_seq_len, dummy_location=num_pages * page_size, device=torch.device("cpu"))
    return PagedAllocator(num_pages, page_size, table, make_cache(cache_kind, page_size))


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def run_forward(allocator: PagedAllocator, request, length: int) -> None:
    """Pretend a forward computed the request up to ``length`` tokens."""
    allocator.allocate([request], [length])
    allocator.mark_computed([request])


def snapshot(allocator: PagedAllocator, requests=()):
    return (
        allocator.free_page_starts.tolist(),
        allocator.page_table.table.clone(),
        allocator.prefix_cache.size_info,
        [(r.cached_len, r.device_len, r.allocated_len) for r in requests],
        allocator.evicted_tokens,
    )


def assert_same(before, after) -> None:
    assert before[0] == after[0] and torch.equal(before[1], after[1]) and before[2:] == after[2:]


# ---------------------------------------------------------------------- exact table contents


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_table_holds_exactly_the_expected_locations(page_size):
    allocator = make_allocator("naive", page_size=page_size, num_pages=40, max_seq_len=96)
    lengths = [5, 1, 2 * page_size + 1]
    requests = [allocator.open_request(row, torch.arange(n, dtype=torch.int32)) for row, n in enumerate(lengths)]
    allocator.allocate(requests, lengths)
    # the free list starts as 0, P, 2P, ...: pages are handed out in order, request by request
    next_page = 0
    for request, n in zip(requests, lengths):
        pages = -(-n // page_size)
        expected = torch.arange(next_page * page_size, (next_page + pages) * page_size, dtype=torch.int32)
        assert torch.equal(allocator.page_table.table[request.row, : pages * page_size], expected)
        assert request.allocated_len == pages * page_size and request.device_len == n
        next_page += pages
    assert allocator.num_free_pages == 40 - next_page
    allocator.check_integrity()


def test_growth_inside_a_page_allocates_nothing_and_the_next_page_continues_the_row():
    allocator = make_allocator("naive", page_size=4)
    request = allocator.open_request(0, torch.arange(9, dtype=torch.int32))
    allocator.allocate([request], [2])
    assert allocator.num_free_pages == 15
    allocator.allocate([request], [4])
    assert allocator.num_free_pages == 15
    allocator.allocate([request], [5])
    assert allocator.num_free_pages == 14
    assert allocator.page_table.table[0, :8].tolist() == list(range(8))
    allocator.check_integrity()


def test_one_batch_write_covers_several_requests_with_uneven_growth():
    allocator = make_allocator("naive", page_size=2, num_pages=20)
    a = allocator.open_request(0, torch.arange(7, dtype=torch.int32))
    b = allocator.open_request(1, torch.arange(3, dtype=torch.int32))
    allocator.allocate([a], [3])  # pages 0, 1
    allocator.allocate([a, b], [7, 3])  # a: pages 2, 3; b: pages 4, 5
    assert allocator.page_table.table[0, :8].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert allocator.page_table.table[1, :4].tolist() == [8, 9, 10, 11]
    allocator.check_integrity()


def test_rows_that_page_size_does_not_divide_record_only_columns_inside_the_row():
    # row width 64 (max_seq_len 50), page 48: the second page reaches column 96
    allocator = make_allocator("naive", page_size=48, num_pages=4, max_seq_len=50)
    request = allocator.open_request(0, torch.arange(50, dtype=torch.int32))
    allocator.allocate([request], [50])
    assert allocator.page_table.table[0, :64].tolist() == list(range(64))
    assert request.allocated_len == 96
    allocator.check_integrity()
    allocator.cache_request(request, finished=True)
    assert sorted(allocator.free_page_starts.tolist()) == [0, 48, 96, 144]


# ---------------------------------------------------------------------- shortage and eviction


def test_dummy_page_is_never_handed_out_even_when_the_pool_is_drained():
    allocator = make_allocator("naive", page_size=4, num_pages=8, rows=2, max_seq_len=64)
    request = allocator.open_request(0, torch.arange(32, dtype=torch.int32))
    allocator.allocate([request], [32])
    assert allocator.num_free_pages == 0
    assert int(allocator.page_table.table[0, :32].max()) < 8 * 4
    other = allocator.open_request(1, ids(1, 2))
    with pytest.raises(OutOfMemoryError):
        allocator.allocate([other], [2])
    allocator.check_integrity()


@pytest.mark.parametrize("cache_kind", CACHES)
def test_failed_allocation_changes_nothing(cache_kind):
    allocator = make_allocator(cache_kind, page_size=4, num_pages=10)
    done = allocator.open_request(0, torch.arange(12, dtype=torch.int32))
    run_forward(allocator, done, 12)
    allocator.cache_request(done, finished=True)  # radix/dict now hold 2 evictable pages
    live = allocator.open_request(1, torch.arange(100, 120, dtype=torch.int32))
    run_forward(allocator, live, 8)
    other = allocator.open_request(2, torch.arange(200, 240, dtype=torch.int32))
    before = snapshot(allocator, [live, other])
    with pytest.raises(OutOfMemoryError) as error:
        allocator.allocate([live, other], [20, 40])  # 3 + 10 pages
    message = str(error.value)
    assert "needs 13 pages" in message and f"{allocator.num_free_pages} free" in message
    assert_same(before, snapshot(allocator, [live, other]))
    if isinstance(allocator.prefix_cache, DictPrefixCache):
        assert allocator.prefix_cache.evict_calls == []  # nothing evicted on the failure path
    allocator.check_integrity()


@pytest.mark.parametrize("cache_kind", REUSING_CACHES)
def test_shortage_evicts_only_the_missing_pages_and_the_free_list_stays_aligned(cache_kind):
    allocator = make_allocator(cache_kind, page_size=4, num_pages=10)
    for row, base in enumerate((0, 100)):
        request = allocator.open_request(row, torch.arange(base, base + 17, dtype=torch.int32))
        run_forward(allocator, request, 17)
        allocator.cache_request(request, finished=True)
    assert allocator.num_cached_pages == 8 and allocator.num_free_pages == 2
    newcomer = allocator.open_request(0, torch.arange(500, 520, dtype=torch.int32))
    allocator.allocate([newcomer], [20])  # 5 pages: 2 free + 3 evicted
    assert allocator.evicted_tokens >= 12
    assert all(start % 4 == 0 and 0 <= start < 40 for start in allocator.free_page_starts.tolist())
    row = allocator.page_table.table[0, :20]
    assert bool((row[::4] % 4 == 0).all())
    assert allocator.num_cached_pages + allocator.num_free_pages + 5 == 10
    allocator.check_integrity()


def test_evicted_pages_come_from_least_recently_used_unlocked_entries():
    allocator = make_allocator("dict", page_size=2, num_pages=6)
    old = allocator.open_request(0, ids(1, 2, 3))
    run_forward(allocator, old, 3)
    allocator.cache_request(old, finished=True)  # caches page [1, 2] at locations 0, 1
    recent = allocator.open_request(0, ids(7, 8, 9))
    run_forward(allocator, recent, 3)
    allocator.cache_request(recent, finished=True)  # caches [7, 8] at locations 4, 5... after the tail frees
    cache = allocator.prefix_cache
    old_page = cache.pages[(1, 2)].locations
    big = allocator.open_request(1, torch.arange(50, 60, dtype=torch.int32))
    allocator.allocate([big], [10])  # 5 pages: 4 free + 1 evicted
    assert (1, 2) not in cache.pages and (7, 8) in cache.pages
    assert old_page[0] in allocator.page_table.table[1, :10].tolist()
    allocator.check_integrity()


# ---------------------------------------------------------------------- cache_request


@pytest.mark.parametrize("cache_kind", REUSING_CACHES)
def test_finished_duplicate_prefix_is_freed_and_the_cache_keeps_the_first_copy(cache_kind):
    allocator = make_allocator(cache_kind, page_size=4, num_pages=16)
    prompt = torch.arange(10, dtype=torch.int32)
    first = allocator.open_request(0, prompt)
    second = allocator.open_request(1, prompt)  # no match yet: both compute the prompt
    run_forward(allocator, first, 10)
    run_forward(allocator, second, 10)
    first_locations = allocator.page_table.table[0, :8].clone()
    allocator.cache_request(first, finished=True)
    assert allocator.num_cached_pages == 2 and allocator.num_free_pages == 16 - 2 - 3  # cache + second
    allocator.cache_request(second, finished=True)
    assert allocator.num_cached_pages == 2 and allocator.num_free_pages == 16 - 2
    third = allocator.open_request(0, prompt)
    assert third.matched_len == 8
    assert torch.equal(allocator.page_table.table[0, :8], first_locations)
    allocator.check_integrity()


@pytest.mark.parametrize("cache_kind", REUSING_CACHES)
def test_unfinished_request_points_its_row_at_the_cached_copy_and_keeps_its_tail(cache_kind):
    allocator = make_allocator(cache_kind, page_size=4, num_pages=16)
    prompt = torch.arange(30, dtype=torch.int32)
    leader = allocator.open_request(0, prompt)
    chunked = allocator.open_request(1, prompt)
    run_forward(allocator, leader, 16)
    allocator.cache_request(leader, finished=True)  # cache: tokens 0..15
    run_forward(allocator, chunked, 10)  # computed its own copy of 0..9 meanwhile
    free_before = allocator.num_free_pages
    allocator.cache_request(chunked, finished=False)
    cached = allocator.prefix_cache.match_prefix(prompt[:8]).handle.get_matched_indices()
    assert torch.equal(allocator.page_table.table[1, :8], cached)  # row rewritten to the cache's pages
    assert chunked.prefix_len == 8 and allocator.num_free_pages == free_before + 2
    assert allocator.prefix_cache.size_info.protected_size == 8
    run_forward(allocator, chunked, 30)
    allocator.check_integrity()
    allocator.cache_request(chunked, finished=True)
    assert allocator.prefix_cache.size_info.protected_size == 0
    assert allocator.num_free_pages + allocator.num_cached_pages == 16
    allocator.check_integrity()


def test_naive_cache_gets_every_page_back_on_finish_and_keeps_pages_while_unfinished():
    allocator = make_allocator("naive", page_size=4, num_pages=16)
    request = allocator.open_request(0, torch.arange(30, dtype=torch.int32))
    run_forward(allocator, request, 13)
    allocator.cache_request(request, finished=False)
    assert allocator.num_free_pages == 12 and request.prefix_len == 0
    allocator.check_integrity()
    run_forward(allocator, request, 30)
    allocator.cache_request(request, finished=True)
    assert allocator.num_free_pages == 16 and request.finished
    allocator.check_integrity()


# ---------------------------------------------------------------------- lazy frees and misuse


def test_lazy_free_applies_frees_at_the_end_of_the_outermost_region():
    allocator = make_allocator("naive", page_size=4, num_pages=8)
    a = allocator.open_request(0, torch.arange(8, dtype=torch.int32))
    b = allocator.open_request(1, torch.arange(8, dtype=torch.int32))
    allocator.allocate([a, b], [8, 8])
    with allocator.lazy_free():
        allocator.cache_request(a, finished=True)
        with allocator.lazy_free():
            allocator.cache_request(b, finished=True)
        assert allocator.num_free_pages == 4
        allocator.check_integrity()  # pending frees still count as free
        c = allocator.open_request(2, torch.arange(20, dtype=torch.int32))
        with pytest.raises(OutOfMemoryError, match="pending lazy frees"):
            allocator.allocate([c], [20])
    assert allocator.num_free_pages == 8
    allocator.allocate([c], [20])
    allocator.check_integrity()


@pytest.mark.parametrize("cache_kind", REUSING_CACHES)
def test_eviction_inside_a_lazy_region_serves_the_allocation_that_asked(cache_kind):
    allocator = make_allocator(cache_kind, page_size=4, num_pages=6)
    done = allocator.open_request(0, torch.arange(17, dtype=torch.int32))
    run_forward(allocator, done, 17)
    allocator.cache_request(done, finished=True)  # 4 cached pages, 2 free
    with allocator.lazy_free():
        newcomer = allocator.open_request(1, torch.arange(50, 70, dtype=torch.int32))
        allocator.allocate([newcomer], [20])  # 5 pages: 2 free + 3 evicted now, not at the region's end
        assert newcomer.allocated_len == 20
        allocator.check_integrity()
    allocator.check_integrity()


def test_misuse_raises_and_changes_nothing():
    allocator = make_allocator("dict", page_size=4)
    request = allocator.open_request(0, torch.arange(10, dtype=torch.int32))
    before = snapshot(allocator, [request])
    bad_calls = [
        lambda: allocator.allocate([request, request], [4, 4]),
        lambda: allocator.allocate([request], [4, 5]),
        lambda: allocator.allocate([request], [65]),
        lambda: allocator.open_request(0, ids(1, 2)),  # row already live
        lambda: allocator.open_request(4, ids(1, 2)),  # the dummy row
        lambda: allocator.open_request(1, torch.empty(0, dtype=torch.int32)),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidArgumentError):
            call()
        assert_same(before, snapshot(allocator, [request]))
    allocator.cache_request(request, finished=True)
    with pytest.raises(InvalidArgumentError, match="not live"):
        allocator.allocate([request], [4])
    with pytest.raises(InvalidArgumentError, match="not live"):
        allocator.cache_request(request, finished=True)


def test_check_integrity_catches_a_page_owned_twice_and_a_misaligned_free_list():
    allocator = make_allocator("naive", page_size=4, num_pages=8)
    request = allocator.open_request(0, torch.arange(8, dtype=torch.int32))
    allocator.allocate([request], [8])
    allocator.check_integrity()
    free = allocator.free_list._free
    allocator.free_list._free = np.concatenate([free[:-1], allocator.page_table.host_table[0, :1]])  # a live page is "free"
    with pytest.raises(AssertionError, match="owned twice"):
        allocator.check_integrity()
    allocator.free_list._free = np.concatenate([free[:-1], free[-1:] + 1])
    with pytest.raises(AssertionError, match="multiple of page_size"):
        allocator.check_integrity()
    allocator.free_list._free = free[:-1]
    with pytest.raises(AssertionError, match="conservation"):
        allocator.check_integrity()
    allocator.free_list._free = np.concatenate([free[:-1], np.array([32], dtype=np.int32)])
    with pytest.raises(AssertionError, match="dummy page"):
        allocator.check_integrity()
