"""Radix-specific behaviour: tree shape, splits, lock propagation, cascading and incremental eviction,
bad input, devices. The contract itself is covered by the conformance kit (test_conformance.py)."""

from __future__ import annotations

import pytest
import torch

import kvplug
import kvplug.testing
from kvplug.interface import InvalidArgumentError
from kvplug.prefix_cache import radix_candidates
from kvplug.prefix_cache.radix import RadixPrefixCache
from kvplug.prefix_cache.radix_keys import as_int32

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def span(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count, dtype=torch.int32)


def radix(page_size: int = 1, device: str = "cpu") -> RadixPrefixCache:
    cache = kvplug.create_prefix_cache("radix", page_size=page_size, device=device)
    assert isinstance(cache, RadixPrefixCache)
    return cache


def tree(cache: RadixPrefixCache, node=None) -> dict:
    """The tree as nested dicts: {token ids of the edge: (locations, lock_ref, subtree)}."""
    node = node or cache._root
    return {
        tuple(as_int32(child.key).tolist()): (
            as_int32(child.value).tolist(),
            child.lock_ref,
            tree(cache, child),
        )
        for child in node.children.values()
    }


def snapshot(cache: RadixPrefixCache):
    def walk(node):
        return [
            (child.key, child.value, child.lock_ref, child.own_locks, child.last_access, child.heap_seq, walk(child))
            for child in node.children.values()
        ]

    return walk(cache._root), tuple(cache.size_info), len(cache._candidates), cache._clock


def test_diverging_insert_splits_the_edge_and_keeps_values():
    cache = radix(page_size=2)
    cache.insert_prefix(ids(1, 1, 2, 2, 3, 3), span(10, 6))
    assert cache.insert_prefix(ids(1, 1, 2, 2, 4, 4), span(20, 6)).cached_len == 4
    assert tree(cache) == {
        (1, 1, 2, 2): ([10, 11, 12, 13], 0, {(3, 3): ([14, 15], 0, {}), (4, 4): ([24, 25], 0, {})})
    }
    assert cache.size_info == (8, 0)
    cache.check_integrity()


def test_a_partial_match_splits_so_the_handle_ends_on_a_node():
    cache = radix(page_size=2)
    cache.insert_prefix(ids(1, 1, 2, 2, 3, 3), span(10, 6))
    handle = cache.match_prefix(ids(1, 1, 2, 2, 9)).handle  # the odd token is a partial page
    assert handle.cached_len == 4 and handle.get_matched_indices().tolist() == [10, 11, 12, 13]
    assert tree(cache) == {(1, 1, 2, 2): ([10, 11, 12, 13], 0, {(3, 3): ([14, 15], 0, {})})}
    assert handle is cache._root.children[ids(1, 1).numpy().tobytes()]  # the handle is the upper node
    cache.check_integrity()


def test_a_mismatch_inside_a_page_rounds_the_match_down():
    cache = radix(page_size=4)
    cache.insert_prefix(ids(1, 2, 3, 4, 5, 6, 7, 8), span(0, 8))
    assert cache.match_prefix(ids(1, 2, 3, 4, 5, 6, 0, 8)).handle.cached_len == 4
    assert cache.match_prefix(ids(1, 2, 3, 0)).handle.cached_len == 0


def test_locks_propagate_to_the_root_and_splits_copy_them():
    cache = radix()
    cache.insert_prefix(ids(1, 2), span(0, 2))
    deep = cache.insert_prefix(ids(1, 2, 3, 4), span(10, 4)).handle
    cache.lock_handle(deep)
    assert tree(cache) == {(1, 2): ([0, 1], 1, {(3, 4): ([12, 13], 1, {})})}
    cache.match_prefix(ids(1, 2, 3, 9))  # splits the locked edge
    assert tree(cache) == {(1, 2): ([0, 1], 1, {(3,): ([12], 1, {(4,): ([13], 1, {})})})}
    assert cache.size_info == (0, 4) and cache._root.lock_ref == 0
    cache.lock_handle(deep, unlock=True)
    assert cache.size_info == (4, 0)
    cache.check_integrity()


def test_eviction_cascades_from_leaves_to_parents_that_become_leaves():
    cache = radix()
    cache.insert_prefix(ids(1), span(0, 1))
    cache.insert_prefix(ids(1, 2), span(0, 2))
    cache.insert_prefix(ids(1, 2, 3), span(0, 3))  # a chain of three one-token nodes
    assert cache.evict(1).tolist() == [2]
    assert cache.evict(2).tolist() == [1, 0]  # the parent became a leaf and follows in the same call
    assert cache.size_info == (0, 0) and tree(cache) == {}
    cache.check_integrity()


def test_a_parent_uncovered_by_eviction_keeps_its_own_recency():
    cache = radix()
    cache.insert_prefix(ids(1, 2), span(0, 2))  # tick 1
    cache.match_prefix(ids(1))  # tick 2: splits, the upper node [1] is newer than its child [2]
    cache.insert_prefix(ids(5), span(10, 1))  # tick 3
    cache.match_prefix(ids(1))  # tick 4
    assert cache.evict(1).tolist() == [1]  # leaf [2], tick 1
    assert cache.evict(1).tolist() == [10]  # then [5] (tick 3) before the uncovered parent [1] (tick 4)
    assert cache.evict(1).tolist() == [0]


def test_evicting_from_many_leaves_pops_only_what_it_evicts(monkeypatch):
    cache = radix(page_size=4)
    for leaf in range(3000):
        cache.insert_prefix(ids(7, 7, 7, 7, leaf, leaf, leaf, leaf), span(8 * leaf, 8))
    cache.check_integrity()
    entries = cache._candidates.heap_entries
    monkeypatch.setattr(radix_candidates, "heapify", lambda heap: pytest.fail("evict rebuilt the heap"))
    freed = cache.evict(16)
    assert sorted(freed.tolist()) == [8 * leaf + offset for leaf in range(4) for offset in range(4, 8)]
    assert entries - cache._candidates.heap_entries == 4  # one entry taken per evicted leaf: no scan, no rebuild
    monkeypatch.undo()
    cache.check_integrity()


def test_refreshing_the_same_leaf_keeps_the_candidate_heap_bounded():
    cache = radix()
    for leaf in range(10):
        cache.insert_prefix(ids(leaf), span(leaf, 1))
    for _ in range(5000):
        cache.match_prefix(ids(3))  # each refresh of a candidate pushes a new heap entry
    assert cache._candidates.heap_entries <= 2 * len(cache._candidates) + 64
    assert cache.evict(9).tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9]  # [3] is the most recently used
    cache.check_integrity()


def test_unlocking_makes_a_leaf_a_candidate_again():
    cache = radix()
    handle = cache.insert_prefix(ids(1, 2), span(0, 2)).handle
    cache.lock_handle(handle)
    assert len(cache._candidates) == 0
    with pytest.raises(InvalidArgumentError, match="only 0 are evictable"):
        cache.evict(1)
    cache.lock_handle(handle, unlock=True)
    assert len(cache._candidates) == 1 and cache.evict(1).tolist() == [0, 1]


def test_matched_indices_are_a_copy_and_strided_inputs_work():
    cache = radix()
    cache.insert_prefix(torch.arange(0, 20, 2, dtype=torch.int32)[::2], span(0, 5))  # a strided view
    indices = cache.match_prefix(ids(0, 4, 8)).handle.get_matched_indices()
    indices.fill_(-1)
    assert cache.match_prefix(ids(0, 4, 8)).handle.get_matched_indices().tolist() == [0, 1, 2]


def strided(values: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (the general, copying input path)."""
    return values.repeat_interleave(2)[::2]


def subclassed(values: torch.Tensor) -> torch.Tensor:
    """The same values in a ``torch.Tensor`` subclass (also the general path)."""
    return torch.nn.Parameter(values.clone(), requires_grad=False)


@pytest.mark.parametrize("convert", [strided, subclassed])
@pytest.mark.parametrize("page_size", [1, 4])
def test_general_path_inputs_build_the_same_tree_as_dense_inputs(convert, page_size):
    generator = torch.Generator().manual_seed(page_size)
    dense, general = radix(page_size), radix(page_size)
    for step in range(60):
        length = int(torch.randint(0, 6, (1,), generator=generator)) * page_size
        tokens = torch.randint(0, 3, (length + step % 2,), dtype=torch.int32, generator=generator)
        if step % 3:
            aligned = tokens[: length]
            results = [cache.insert_prefix(ids_, span(100 * step, length))
                       for cache, ids_ in ((dense, aligned), (general, convert(aligned)))]
            assert results[0].cached_len == results[1].cached_len
        else:
            handles = [dense.match_prefix(tokens).handle, general.match_prefix(convert(tokens)).handle]
            assert handles[0].cached_len == handles[1].cached_len
            assert torch.equal(handles[0].get_matched_indices(), handles[1].get_matched_indices())
        assert snapshot(dense) == snapshot(general)
    general.check_integrity()


def test_the_cache_copies_what_it_keeps_out_of_the_callers_tensors():
    cache = radix(page_size=2)
    tokens, locations = ids(1, 2, 3, 4, 5, 6), span(10, 6)
    cache.insert_prefix(tokens[:2], locations[:2])
    cache.insert_prefix(tokens, locations)  # read in place, the new pages copied
    tokens.fill_(7)
    locations.fill_(-1)
    handle = cache.match_prefix(ids(1, 2, 3, 4, 5, 6)).handle
    assert handle.cached_len == 6 and handle.get_matched_indices().tolist() == list(range(10, 16))
    assert cache.match_prefix(tokens).handle.cached_len == 0
    cache.check_integrity()


NAIVE = kvplug.create_prefix_cache("naive")
BAD_CALLS = {
    "insert int64 ids": lambda c: c.insert_prefix(ids(1, 2, 3, 4).long(), span(0, 4)),
    "insert int64 locations": lambda c: c.insert_prefix(ids(1, 2, 3, 4), span(0, 4).long()),
    "insert a partial page": lambda c: c.insert_prefix(ids(1, 2, 3), span(0, 3)),
    "insert unequal lengths": lambda c: c.insert_prefix(ids(1, 2, 3, 4), span(0, 2)),
    "insert 2-D": lambda c: c.insert_prefix(ids(1, 2, 3, 4).view(2, 2), span(0, 4).view(2, 2)),
    "insert on another device": lambda c: c.insert_prefix(torch.empty(2, dtype=torch.int32, device="meta"), span(0, 2)),
    "insert a list": lambda c: c.insert_prefix([1, 2], span(0, 2)),
    "match int64": lambda c: c.match_prefix(ids(1, 2).long()),
    "match a sparse tensor": lambda c: c.match_prefix(ids(1, 2).to_sparse()),
    "insert sparse locations": lambda c: c.insert_prefix(ids(1, 2, 3, 4), span(0, 4).to_sparse()),
    "evict -1": lambda c: c.evict(-1),
    "evict a float": lambda c: c.evict(1.5),
    "evict True": lambda c: c.evict(True),
    "insert a negative location": lambda c: c.insert_prefix(ids(7, 8, 9, 9), ids(30, 31, -5, 33)),
    "insert a location twice": lambda c: c.insert_prefix(ids(7, 8, 9, 9), ids(30, 31, 32, 30)),
    "insert a negative duplicate location in the new part": lambda c: c.insert_prefix(ids(1, 2, 7, 8), ids(90, 91, -5, -5)),
    "insert a location twice in the new part after a split": lambda c: c.insert_prefix(ids(1, 2, 3, 9), ids(0, 0, 41, 41)),
    "insert a location twice through a view": lambda c: c.insert_prefix(ids(7, 8, 9, 9), ids(30, 0, 31, 0, 30, 0, 32, 0)[::2]),
    "evict None": lambda c: c.evict(None),
    "evict a string": lambda c: c.evict("3"),
    "evict 0.0": lambda c: c.evict(0.0),
    "evict too much": lambda c: c.evict(c.size_info.evictable_size + 1),
    "unlock an unlocked prefix": lambda c: c.lock_handle(c.unlocked_handle, unlock=True),
    "unlock a never-locked prefix of a locked handle": lambda c: c.lock_handle(c.prefix_of_locked, unlock=True),
    "unlock flag not a bool": lambda c: c.lock_handle(c.unlocked_handle, unlock=1),
    "lock None": lambda c: c.lock_handle(None),
    "lock a foreign handle": lambda c: c.lock_handle(radix(2).match_prefix(ids(1, 2)).handle),
    "lock a handle of another kind": lambda c: c.lock_handle(NAIVE.match_prefix(ids()).handle),
}


@pytest.mark.parametrize("what", list(BAD_CALLS))
def test_bad_input_raises_and_leaves_the_tree_unchanged(what):
    cache = radix(page_size=2)
    cache.insert_prefix(ids(1, 2, 3, 4), span(0, 4))
    cache.insert_prefix(ids(1, 2, 5, 6), span(10, 4))
    cache.lock_handle(cache.match_prefix(ids(1, 2, 3, 4)).handle)
    cache.unlocked_handle = cache.match_prefix(ids(1, 2, 5, 6)).handle
    cache.prefix_of_locked = cache.match_prefix(ids(1, 2)).handle
    assert cache.prefix_of_locked.lock_ref == 1  # covered by the lock on (1, 2, 3, 4), but not its own
    before = snapshot(cache)
    with pytest.raises(InvalidArgumentError):
        BAD_CALLS[what](cache)
    assert snapshot(cache) == before
    cache.check_integrity()


def test_unlocking_a_prefix_of_a_locked_handle_is_refused_and_the_real_unlock_still_works():
    """A never-locked prefix shares the locked handle's nodes: unlocking it used to be accepted,
    leaving the longer handle's nodes with more locks than their parent (then evict asserted)."""
    cache = radix(page_size=2)
    cache.insert_prefix(ids(1, 2, 3, 4, 5, 6), span(0, 6))
    locked = cache.match_prefix(ids(1, 2, 3, 4, 5, 6)).handle
    cache.lock_handle(locked)
    prefix = cache.match_prefix(ids(1, 2)).handle  # splits the edge; the prefix is a new upper node
    for _ in range(2):
        with pytest.raises(InvalidArgumentError, match="no lock of its own"):
            cache.lock_handle(prefix, unlock=True)
    assert cache.size_info == (0, 6)
    cache.check_integrity()
    cache.lock_handle(prefix)  # its own lock, then its own unlock: nested counts
    cache.lock_handle(prefix, unlock=True)
    cache.lock_handle(locked, unlock=True)
    with pytest.raises(InvalidArgumentError, match="not locked"):
        cache.lock_handle(locked, unlock=True)
    assert cache.size_info == (6, 0)
    assert sorted(cache.evict(6).tolist()) == list(range(6))
    cache.check_integrity()


NAIVE_AND_RADIX_BAD_CALLS = {
    "match None": lambda c: c.match_prefix(None),
    "match int64": lambda c: c.match_prefix(ids(1, 2).long()),
    "match 2-D": lambda c: c.match_prefix(ids(1, 2).view(1, 2)),
    "insert unequal lengths": lambda c: c.insert_prefix(ids(1, 2), span(0, 1)),
    "insert a partial page": lambda c: c.insert_prefix(ids(1, 2, 3), span(0, 3)),
    "insert a negative location": lambda c: c.insert_prefix(ids(1, 2), ids(-1, 0)),
    "insert a location twice": lambda c: c.insert_prefix(ids(1, 2), ids(3, 3)),
    "insert None": lambda c: c.insert_prefix(None, span(0, 2)),
    "evict None": lambda c: c.evict(None),
    "evict a string": lambda c: c.evict("3"),
    "evict 0.0": lambda c: c.evict(0.0),
    "evict True": lambda c: c.evict(True),
    "evict -1": lambda c: c.evict(-1),
    "evict too much": lambda c: c.evict(2),
    "lock None": lambda c: c.lock_handle(None),
    "lock with a non-bool flag": lambda c: c.lock_handle(c.match_prefix(ids(1, 2)).handle, unlock="yes"),
}


@pytest.mark.parametrize("what", list(NAIVE_AND_RADIX_BAD_CALLS))
def test_naive_and_radix_refuse_bad_arguments_identically(what):
    """One validation helper for both built-in caches: the same error type and message."""
    messages = []
    for name in ("naive", "radix"):
        cache = kvplug.create_prefix_cache(name, page_size=2)
        with pytest.raises(InvalidArgumentError) as raised:
            NAIVE_AND_RADIX_BAD_CALLS[what](cache)
        messages.append(str(raised.value).replace(name, "CACHE"))
        assert cache.size_info == (0, 0)
    if what != "evict too much":  # the sizes in that message are each cache's own
        assert messages[0] == messages[1]


def test_stale_handles_are_rejected():
    cache = radix()
    evicted = cache.insert_prefix(ids(1, 2), span(0, 2)).handle
    cache.evict(2)
    with pytest.raises(InvalidArgumentError, match="was evicted"):
        cache.lock_handle(evicted)
    before_reset = cache.insert_prefix(ids(3), span(5, 1)).handle
    cache.reset()
    with pytest.raises(InvalidArgumentError, match="reset"):
        cache.lock_handle(before_reset)
    empty = cache.match_prefix(ids(9)).handle
    cache.lock_handle(empty)  # a handle covering nothing locks nothing
    cache.lock_handle(empty, unlock=True)
    assert cache.size_info == (0, 0)


@pytest.mark.gpu
@requires_cuda
def test_cuda_cache_returns_locations_on_the_device():
    cache = radix(page_size=2, device="cuda")
    cuda = torch.device("cuda", torch.cuda.current_device())
    inserted = cache.insert_prefix(ids(1, 2, 3, 4).to(cuda), span(0, 4).to(cuda))
    assert inserted.handle.get_matched_indices().device == cuda
    matched = cache.match_prefix(ids(1, 2, 3, 9).to(cuda)).handle
    assert matched.get_matched_indices().device == cuda and matched.get_matched_indices().tolist() == [0, 1]
    freed = cache.evict(4)
    assert freed.device == cuda and sorted(freed.tolist()) == [0, 1, 2, 3]
    with pytest.raises(InvalidArgumentError, match="must be on"):
        cache.match_prefix(ids(1, 2))  # a CPU tensor for a CUDA cache


@pytest.mark.gpu
@requires_cuda
def test_cuda_cache_passes_the_kit():
    from kvplug.testing import check_prefix_cache

    check_prefix_cache(RadixPrefixCache, page_sizes=(1, 16), device="cuda")


def _split_tail_scenario(cache):
    ids = lambda *tokens: torch.tensor(tokens, dtype=torch.int32)  # noqa: E731
    cache.insert_prefix(ids(1, 2, 3, 4), ids(10, 11, 12, 13))
    cache.insert_prefix(ids(9), ids(19))
    assert cache.match_prefix(ids(1, 2, 7)).handle.cached_len == 2  # splits [1 2 | 3 4]
    freed = cache.evict(1).tolist()
    cache.check_integrity()
    return freed


def test_strict_lru_evicts_the_unused_tail_of_a_split_first():
    assert _split_tail_scenario(kvplug.create_prefix_cache("radix")) == [12, 13]


def test_split_refreshes_tail_option_gives_sglangs_eviction_order():
    cache = kvplug.create_prefix_cache("radix", split_refreshes_tail=True)
    assert _split_tail_scenario(cache) == [19]
    kvplug.testing.check_prefix_cache(
        lambda config: kvplug.create_prefix_cache("radix", page_size=config.page_size, split_refreshes_tail=True),
        page_sizes=(1, 4), lru=False,
    )


@pytest.mark.parametrize("options", [{"split_refreshes_tail": 1}, {"capacity": 3}])
def test_bad_radix_options_are_rejected(options):
    with pytest.raises(kvplug.InvalidArgumentError, match="split_refreshes_tail"):
        kvplug.create_prefix_cache("radix", **options)


# ------------------------------------------------------------------ reading arguments safely (issue 25)


def _freed(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its storage freed under it (what FSDP-style code does): its shape stays."""
    tensor.untyped_storage().resize_(0)
    return tensor


def _freed_view(tensor: torch.Tensor, part: slice) -> torch.Tensor:
    """A view of ``tensor`` whose shared storage is then freed."""
    view = tensor[part]
    tensor.untyped_storage().resize_(0)
    return view


FREED_OR_FOREIGN_CALLS = {
    "match freed ids": lambda c: c.match_prefix(_freed(ids(1, 2, 3, 4))),
    "insert freed ids": lambda c: c.insert_prefix(_freed(ids(7, 8, 9, 9)), span(50, 4)),
    "insert freed locations": lambda c: c.insert_prefix(ids(7, 8, 9, 9), _freed(span(50, 4))),
    "match a strided view of freed ids": lambda c: c.match_prefix(_freed_view(span(0, 8), slice(None, None, 2))),
    "insert an offset view of freed locations": lambda c: c.insert_prefix(ids(7, 8), _freed_view(span(0, 8), slice(4, 6))),
    "insert locations longer than the ids": lambda c: c.insert_prefix(ids(7, 8), span(50, 4)),
    "insert ids longer than the locations": lambda c: c.insert_prefix(ids(7, 8, 9, 9), span(50, 2)),
    "match an object posing as a tensor": lambda c: c.match_prefix(_PosingTensor()),
    "insert an object posing as a tensor": lambda c: c.insert_prefix(ids(7, 8), _PosingTensor()),
}


class _PosingTensor:
    """Has the attributes the old fast path read (``data_ptr``, ``nbytes``, ...), pointing anywhere."""

    dtype = torch.int32
    is_cpu = True
    nbytes = 1 << 20
    shape = (1 << 18,)
    ndim = 1

    def data_ptr(self) -> int:
        return 4096

    def stride(self) -> tuple[int]:
        return (1,)


@pytest.mark.parametrize("what", list(FREED_OR_FOREIGN_CALLS))
def test_freed_foreign_or_mismatched_tensors_raise_instead_of_reading_memory(what):
    cache = radix(page_size=2)
    cache.insert_prefix(ids(1, 2, 3, 4), span(0, 4))
    before = snapshot(cache)
    with pytest.raises(InvalidArgumentError):
        FREED_OR_FOREIGN_CALLS[what](cache)
    assert snapshot(cache) == before
    cache.check_integrity()


def test_no_prefix_cache_module_reads_raw_process_memory():
    """The keys are read through numpy's bounds-checked buffers: no ctypes address arithmetic."""
    import pathlib

    import kvplug.prefix_cache

    for path in pathlib.Path(kvplug.prefix_cache.__file__).parent.glob("*.py"):
        source = path.read_text()
        for trick in ("ctypes", "from_address", "string_at", "data_ptr()"):
            assert trick not in source, f"{path.name} uses {trick}"


def test_strided_and_offset_views_are_read_by_value():
    cache = radix(page_size=2)
    base = ids(0, 1, 0, 2, 0, 3, 0, 4)
    locations = span(100, 10)
    assert cache.insert_prefix(base[1::2], locations[3:7]).cached_len == 0
    assert cache.match_prefix(base[1::2]).handle.get_matched_indices().tolist() == [103, 104, 105, 106]
    assert cache.match_prefix(torch.tensor([9, 1, 2, 3, 4], dtype=torch.int32)[1:]).handle.cached_len == 4
    cache.check_integrity()


# ------------------------------------------------------------------ validation costs O(new pages) (issue 25)


def test_a_repeated_location_in_the_new_part_raises_and_splits_nothing():
    """The match ends inside an edge: the split waits until the new part's locations passed."""
    cache = radix(page_size=2)
    cache.insert_prefix(ids(1, 2, 3, 4, 5, 6), span(0, 6))
    before = snapshot(cache)
    for bad in (ids(90, 91, 92, 93, 7, 7), ids(90, 91, 92, 93, 7, -1), ids(90, 0, 91, 0, 92, 0, 93, 0, 7, 0, 7, 0)[::2]):
        with pytest.raises(InvalidArgumentError, match="distinct|non-negative"):
            cache.insert_prefix(ids(1, 2, 3, 4, 8, 8), bad)
        assert snapshot(cache) == before  # still one edge: no split happened
    assert len(cache._root.children) == 1 and len(next(iter(cache._root.children.values())).children) == 0
    cache.check_integrity()


def test_the_cached_part_of_an_insert_is_not_revalidated():
    """Its locations are the caller's duplicates (it frees them): the cache neither reads nor checks
    them, so garbage there is accepted and the tree keeps its own locations. (ef62ca7 sorted the
    whole prompt's locations on every insert and rejected this.)"""
    cache = radix(page_size=2)
    cache.insert_prefix(ids(1, 2, 3, 4), span(0, 4))
    result = cache.insert_prefix(ids(1, 2, 3, 4, 5, 6), ids(-1, -1, 7, 7, 20, 21))
    assert result.cached_len == 4
    assert result.handle.get_matched_indices().tolist() == [0, 1, 2, 3, 20, 21]
    assert cache.insert_prefix(ids(1, 2, 3, 4, 5, 6), ids(9, 9, 9, 9, 9, 9)).cached_len == 6  # all cached
    cache.check_integrity()


def test_insert_validates_exactly_the_new_part(monkeypatch):
    """Property: whatever the cached prefix, the validator sees only the locations after it."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    import kvplug.prefix_cache.radix as radix_module

    seen: list[list[int]] = []
    real_check = radix_module.check_location_values
    monkeypatch.setattr(radix_module, "check_location_values",
                        lambda values: seen.append(values.tolist()) or real_check(values))

    @hypothesis.settings(max_examples=60, deadline=None)
    @hypothesis.given(
        st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6).map(lambda pages: [t for p in pages for t in (p, p)]),
                 min_size=1, max_size=8)
    )
    def check(prompts):
        cache = radix(page_size=2)
        reference: set[tuple[int, ...]] = {()}  # the cached page-aligned prefixes (the root: length 0)
        next_location = 0
        for prompt in prompts:
            cached = max((k for k in range(0, len(prompt) + 1, 2) if tuple(prompt[:k]) in reference), default=0)
            locations = list(range(next_location, next_location + len(prompt)))
            next_location += len(prompt)
            seen.clear()
            result = cache.insert_prefix(torch.tensor(prompt, dtype=torch.int32), torch.tensor(locations, dtype=torch.int32))
            assert result.cached_len == cached
            assert seen == ([locations[cached:]] if cached < len(prompt) else [])
            reference.update(tuple(prompt[:k]) for k in range(0, len(prompt) + 1, 2))
        cache.check_integrity()

    check()


def test_inserted_leaf_sets_every_slot():
    """``_insert`` builds its new leaf without ``RadixNode.__init__`` (a hot-path inline): every slot
    must hold what the constructor would give it, whatever slots the class grows."""
    from kvplug.prefix_cache.radix_node import RadixNode

    cache = radix(page_size=2)
    cache.insert_prefix(ids(1, 1, 2, 2), span(10, 4))
    leaf = cache.insert_prefix(ids(1, 1, 2, 2, 3, 3), span(10, 6)).handle
    parent = leaf.parent
    built = RadixNode(cache._generation, parent, leaf.key, leaf.value, 6, leaf.last_access, leaf.key[:8])
    for slot in RadixNode.__slots__:
        assert hasattr(leaf, slot), f"the inserted leaf has no {slot}"
        if slot not in ("heap_seq", "children"):  # the leaf is an eviction candidate; children: a fresh dict
            assert getattr(leaf, slot) == getattr(built, slot), slot
    assert leaf.children == {} and leaf.children is not built.children
    assert leaf.heap_seq >= 0 and vars(leaf) == {}
    cache.check_integrity()
