"""The radix cache's host-array calls (``HostArrayCalls``: what kvplug's allocator uses) against its
public tensor methods: the same trees, answers and evictions, the same refusals of bad shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvplug
from kvplug.interface import InvalidArgumentError
from kvplug.prefix_cache.host_arrays import HostArrayCalls
from kvplug.prefix_cache.radix import RadixPrefixCache
from kvplug.prefix_cache.tiered_radix import TieredRadixPrefixCache


def radix(page_size: int) -> RadixPrefixCache:
    return kvplug.create_prefix_cache("radix", page_size=page_size, device="cpu")


def snapshot(cache: RadixPrefixCache):
    def walk(node):
        return sorted(
            (child.key, child.value, child.lock_ref, child.own_locks, child.last_access, child.heap_seq >= 0, walk(child))
            for child in node.children.values()
        )

    return walk(cache._root), tuple(cache.size_info), len(cache._candidates), cache._clock


def test_the_built_in_radix_caches_take_host_arrays_and_a_plugin_base_does_not():
    assert issubclass(RadixPrefixCache, HostArrayCalls)
    assert issubclass(TieredRadixPrefixCache, HostArrayCalls)
    assert not issubclass(kvplug.interface.BasePrefixCache, HostArrayCalls)


@pytest.mark.parametrize("page_size", [1, 4])
def test_host_array_calls_build_the_same_tree_as_tensor_calls(page_size):
    """Differential: one random schedule of match/lock/insert/unlock/evict on twin caches, one
    driven through tensors and one through host arrays (strided views among them)."""
    rng = np.random.default_rng(page_size)
    tensors, arrays = radix(page_size), radix(page_size)
    general = radix(page_size)  # a listener sends evict down the general path: the reference of the leaf loop
    events: list[object] = []
    general.add_kv_event_listener(events.append)
    locked: list[tuple[object, object]] = []
    next_location = 0
    for step in range(400):
        action = rng.integers(0, 10)
        if action < 4:
            length = int(rng.integers(0, 6)) * page_size
            tokens = rng.integers(0, 3, length, dtype=np.int32)
            locations = np.arange(next_location, next_location + length, dtype=np.int32)
            next_location += length
            if step % 5 == 0:  # a strided view of the same values
                tokens, locations = np.repeat(tokens, 2)[::2], np.repeat(locations, 2)[::2]
            expected = tensors.insert_prefix(torch.from_numpy(tokens.copy()), torch.from_numpy(locations.copy()))
            general.insert_prefix(torch.from_numpy(tokens.copy()), torch.from_numpy(locations.copy()))
            cached_len, handle = arrays.insert_host(tokens, locations)
            assert (cached_len, handle.cached_len) == (expected.cached_len, expected.handle.cached_len)
        elif action < 7:
            query = rng.integers(0, 3, int(rng.integers(0, 12)), dtype=np.int32)
            expected = tensors.match_prefix(torch.from_numpy(query)).handle
            handle = arrays.match_host(query)
            reference = general.match_prefix(torch.from_numpy(query)).handle
            assert handle.cached_len == expected.cached_len
            assert torch.equal(handle.get_matched_indices(), expected.get_matched_indices())
            if rng.integers(0, 2):
                tensors.lock_handle(expected)
                arrays.lock_handle(handle)
                general.lock_handle(reference)
                locked.append((expected, handle, reference))
        elif action < 9 and locked:
            for cache, handle in zip((tensors, arrays, general), locked.pop(int(rng.integers(0, len(locked))))):
                cache.lock_handle(handle, unlock=True)
        else:
            size = int(rng.integers(0, tensors.size_info.evictable_size + 1))
            freed = arrays.evict_host(size)
            assert isinstance(freed, np.ndarray) and freed.dtype == np.int32 and not freed.flags.writeable
            assert freed.tolist() == tensors.evict(size).tolist() == general.evict(size).tolist()
        assert snapshot(arrays) == snapshot(tensors)
        assert snapshot(general)[:2] == snapshot(tensors)[:2]  # the same tree, sizes and recency
    arrays.check_integrity()
    general.check_integrity()


def test_host_arrays_are_read_by_value_and_never_kept():
    cache = radix(2)
    tokens = np.array([1, 1, 2, 2, 3, 3], dtype=np.int32)
    locations = np.arange(10, 16, dtype=np.int32)
    assert cache.insert_host(tokens, locations)[0] == 0
    tokens[:] = 9
    locations[:] = 0  # the caller reuses its arrays at once
    handle = cache.match_host(np.array([1, 1, 2, 2, 3], dtype=np.int32))  # the partial page is not matched
    assert handle.cached_len == 4 and handle.get_matched_indices().tolist() == [10, 11, 12, 13]
    cache.check_integrity()


@pytest.mark.parametrize("what", ["tensor", "int64", "big-endian", "2-d", "list", "lengths", "partial page"])
def test_bad_host_arrays_raise_and_leave_the_tree_unchanged(what):
    cache = radix(2)
    cache.insert_host(np.array([1, 1], dtype=np.int32), np.array([0, 1], dtype=np.int32))
    before = snapshot(cache)
    tokens = np.array([1, 1, 2, 2], dtype=np.int32)
    locations = np.arange(10, 14, dtype=np.int32)
    bad = {
        "tensor": (torch.from_numpy(tokens), locations),
        "int64": (tokens.astype(np.int64), locations),
        "big-endian": (tokens, locations.astype(">i4")),
        "2-d": (tokens.reshape(2, 2), locations),
        "list": (tokens.tolist(), locations),
        "lengths": (tokens, locations[:2]),
        "partial page": (tokens[:3], locations[:3]),
    }[what]
    with pytest.raises(InvalidArgumentError):
        cache.insert_host(*bad)
    if what not in ("lengths", "partial page"):
        with pytest.raises(InvalidArgumentError):
            cache.match_host(bad[0] if what != "big-endian" else tokens.astype(">i4"))
    assert snapshot(cache) == before
    cache.check_integrity()


def test_evict_host_of_nothing_is_an_empty_array_and_bad_sizes_raise():
    cache = radix(1)
    assert cache.evict_host(0).shape == (0,)
    with pytest.raises(InvalidArgumentError):
        cache.evict_host(1)
    with pytest.raises(InvalidArgumentError):
        cache.evict_host(True)
    cache.insert_host(np.array([5], dtype=np.int32), np.array([7], dtype=np.int32))
    assert cache.evict_host(np.int64(1)).tolist() == [7]


def test_the_allocator_hands_the_radix_its_host_arrays(monkeypatch):
    """kvplug's allocator calls ``match_host`` / ``insert_host`` / ``evict_host`` on the built-in
    radix, numpy in and out, never its tensor methods (a plugin's cache gets those: test_allocator)."""
    from kvplug.memory.allocator import PagedAllocator
    from kvplug.memory.page_table import PageTable

    seen: list[tuple[str, type]] = []
    for name in ("match_host", "insert_host", "evict_host", "match_prefix", "insert_prefix", "evict"):
        original = getattr(RadixPrefixCache, name)

        def spy(self, *args, name=name, original=original):
            seen.append((name, type(args[0])))
            return original(self, *args)

        monkeypatch.setattr(RadixPrefixCache, name, spy)
    page_size, num_pages = 2, 4
    table = PageTable(2, 16, dummy_location=num_pages * page_size, device=torch.device("cpu"))
    allocator = PagedAllocator(num_pages, page_size, table, radix(page_size))
    assert allocator.host_arrays
    first = allocator.open_request(0, torch.arange(6, dtype=torch.int32))
    allocator.allocate([first])
    allocator.mark_computed([first])
    allocator.cache_request(first, finished=True)  # caches 6 tokens: 3 of the 4 pages
    second = allocator.open_request(0, torch.arange(100, 108, dtype=torch.int32))
    allocator.allocate([second])  # 4 pages: evicts
    assert [name for name, _ in seen] == ["match_host", "insert_host", "match_host", "evict_host"]
    assert {kind for name, kind in seen if name != "evict_host"} == {np.ndarray}
    allocator.cache_request(second, finished=True)
    allocator.check_integrity()
