"""KV cache events of the prefix caches (``add_kv_event_listener``): what a router rebuilds from
the events is always exactly what the cache holds, hashes chain by parent, v1 plugins keep working."""

from __future__ import annotations

import random

import pytest
import torch

import kvplug
import kvplug.testing
from kvplug.interface import AllCleared, BlockRemoved, BlockStored, InvalidArgumentError
from kvplug.prefix_cache.block_hashes import block_hashes
from kvplug.prefix_cache.radix_keys import as_int32


def ids(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


class Router:
    """What a cache-aware router keeps: every stored page by hash, rebuilt from events only."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.events: list = []

    def __call__(self, event) -> None:
        self.events.append(event)
        if isinstance(event, BlockStored):
            assert event.block_size == self.page_size and event.medium == "GPU"
            assert len(event.token_ids) == len(event.block_hashes) * self.page_size
            assert event.parent_block_hash is None or event.parent_block_hash in self.pages, "parent never stored"
            parent = event.parent_block_hash
            for number, block_hash in enumerate(event.block_hashes):
                assert block_hash not in self.pages, "page stored twice"
                page = tuple(event.token_ids[number * self.page_size : (number + 1) * self.page_size])
                self.pages[block_hash] = (parent, page)
                parent = block_hash
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                assert self.pages.pop(block_hash, None) is not None, "removed a page never stored"
        else:
            assert isinstance(event, AllCleared)
            self.pages.clear()

    def prefixes(self) -> set[tuple[int, ...]]:
        """Every cached prefix (one per page), spelled out by following parent links."""
        spelled = set()
        for block_hash in self.pages:
            tokens: list[int] = []
            while block_hash is not None:
                parent, page = self.pages[block_hash]
                tokens[:0] = page
                block_hash = parent
            spelled.add(tuple(tokens))
        return spelled


def radix_prefixes(cache) -> dict[tuple[int, ...], int]:
    """Every page-ending prefix the radix tree holds, with the hash ``block_hashes`` gives it."""
    found = {}
    stack = [(cache._root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            tokens = path + tuple(as_int32(child.key).tolist())
            stack.append((child, tokens))
            hashes = block_hashes(tokens, cache.page_size)
            for pages in range(len(path) // cache.page_size + 1, len(tokens) // cache.page_size + 1):
                found[tokens[: pages * cache.page_size]] = hashes[pages - 1]
    return found


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_replaying_radix_events_rebuilds_exactly_the_cached_pages(page_size, seed):
    rng = random.Random(seed)
    cache = kvplug.create_prefix_cache("radix", page_size=page_size)
    router = Router(page_size)
    assert cache.add_kv_event_listener(router)
    next_location = 0
    locked = []
    for _ in range(300):
        what = rng.random()
        tokens = [rng.randrange(3) for _ in range(page_size * rng.randrange(1, 6))]
        if what < 0.45:
            cache.insert_prefix(ids(tokens), ids(range(next_location, next_location + len(tokens))))
            next_location += len(tokens)
        elif what < 0.6:
            handle = cache.match_prefix(ids(tokens)).handle
            cache.lock_handle(handle)
            locked.append(handle)
        elif what < 0.7 and locked:
            cache.lock_handle(locked.pop(rng.randrange(len(locked))), unlock=True)
        elif what < 0.95:
            cache.evict(rng.randrange(cache.size_info.evictable_size + 1))
        else:
            cache.reset()
            locked.clear()
        held = radix_prefixes(cache)
        assert router.prefixes() == set(held)
        assert set(router.pages) == set(held.values())  # and each page under block_hashes' hash
    kinds = {type(event) for event in router.events}
    assert kinds == {BlockStored, BlockRemoved, AllCleared}


def test_a_split_reports_nothing_and_keeps_the_hashes_for_removal():
    cache = kvplug.create_prefix_cache("radix", page_size=2)
    router = Router(2)
    cache.add_kv_event_listener(router)
    cache.insert_prefix(ids([1, 2, 3, 4, 5, 6]), ids(range(6)))
    cache.match_prefix(ids([1, 2, 3, 4, 9, 9]))  # splits the edge after two pages
    assert len(router.events) == 1
    stored = router.events[0]
    assert stored == BlockStored(block_hashes([1, 2, 3, 4, 5, 6], 2), None, (1, 2, 3, 4, 5, 6), 2, "GPU")
    cache.insert_prefix(ids([1, 2, 3, 4, 7, 8]), ids(range(10, 16)))
    assert router.events[-1] == BlockStored(
        (block_hashes([1, 2, 3, 4, 7, 8], 2)[-1],), stored.block_hashes[1], (7, 8), 2, "GPU"
    )
    cache.evict(6)
    removed = [event.block_hashes for event in router.events if isinstance(event, BlockRemoved)]
    assert sorted(sum(removed, ())) == sorted(stored.block_hashes + router.events[1].block_hashes)
    assert router.pages == {}


def test_a_listener_added_late_gets_hashes_for_pages_stored_before_it():
    cache = kvplug.create_prefix_cache("radix", page_size=1)
    cache.insert_prefix(ids([5, 6, 7]), ids([0, 1, 2]))
    events = []
    cache.add_kv_event_listener(events.append)
    cache.insert_prefix(ids([5, 6, 8]), ids([3, 4, 5]))
    cache.evict(3)
    assert events[0] == BlockStored(block_hashes([5, 6, 8], 1)[-1:], block_hashes([5, 6], 1)[-1], (8,), 1, "GPU")
    removed = sorted(sum((event.block_hashes for event in events[1:]), ()))
    assert removed == sorted(block_hashes([5, 6, 7], 1) + block_hashes([5, 6, 8], 1)[-1:])


def test_removed_listeners_hear_nothing_and_bad_listeners_are_refused():
    cache = kvplug.create_prefix_cache("radix")
    events = []
    cache.add_kv_event_listener(events.append)
    cache.remove_kv_event_listener(events.append)
    cache.remove_kv_event_listener(print)  # never registered: no-op
    cache.insert_prefix(ids([1]), ids([0]))
    cache.reset()
    assert events == [] and not cache.has_kv_event_listeners
    with pytest.raises(InvalidArgumentError, match="callable"):
        cache.add_kv_event_listener("not a function")


def test_naive_reports_only_its_resets():
    cache = kvplug.create_prefix_cache("naive")
    events = []
    assert cache.add_kv_event_listener(events.append)
    cache.insert_prefix(ids([1, 2]), ids([0, 1]))
    cache.evict(0)
    cache.reset()
    assert events == [AllCleared("GPU")]


def test_a_version_1_plugin_without_events_keeps_working():
    from tests.version1_cache import Version1Cache as V1Cache  # written before KV events existed

    cache = V1Cache(kvplug.PrefixCacheConfig())
    events = []
    assert cache.add_kv_event_listener(events.append) is False
    assert cache.insert_prefix(ids([1, 2]), ids([0, 1])).handle.cached_len == 2
    assert cache.evict(2).tolist() == [0, 1]
    assert events == [] and not cache.has_kv_event_listeners
    kvplug.testing.check_prefix_cache(V1Cache, page_sizes=(2,))


def test_block_hashes_chain_by_parent():
    full = block_hashes([1, 2, 3, 4, 5], 2)  # the trailing partial page has no hash
    assert len(full) == 2 and full[:1] == block_hashes([1, 2], 2)
    assert block_hashes([3, 4], 2, parent=full[0]) == full[1:]
    assert block_hashes([3, 4], 2) != full[1:]  # the same page after another prefix is another block
