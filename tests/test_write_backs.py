"""The write-backs of one ``evict`` of the tiered ``radix`` cache are an object that call owns
(issue 25): ``begin_evict`` hands it out, ``keep_evicted`` fills it, ``finish_evict`` takes it once.
A second take, a foreign queue or a dropped one raise ``DeferredWorkError`` and change nothing."""

from __future__ import annotations

import pytest
import torch

from kvplug.builtin.prefix_caches import create_radix
from kvplug.interface import DeferredWorkError
from kvplug.prefix_cache.write_backs import WriteBacks
from kvplug.testing import TieredKit

PAGE = 4


def _kit_with(prompts: list[list[int]], host_pages: int) -> TieredKit:
    """A kit whose cache holds ``prompts`` (in this order, so the first is the least recent)."""
    kit = TieredKit(create_radix, PAGE, host_pages=host_pages)
    start = 0
    for tokens in prompts:
        locations = list(range(start, start + len(tokens)))
        kit.write(tokens, locations)
        kit.cache.insert_prefix(torch.tensor(tokens, dtype=torch.int32), torch.tensor(locations, dtype=torch.int32))
        start += len(tokens)
    return kit


def _state(kit: TieredKit) -> tuple:
    cache = kit.cache
    return cache.size_info, cache.host_size_info, cache.tier_stats(), cache.host_pool.free_pages().tolist()


def _spy(monkeypatch, tier) -> list[tuple[str, object]]:
    """Record which ``WriteBacks`` object each tier call gets or returns."""
    seen: list[tuple[str, object]] = []
    begin, keep, finish = tier.begin_evict, tier.keep_evicted, tier.finish_evict

    def begin_evict():
        write_backs = begin()
        seen.append(("begin_evict", write_backs))
        return write_backs

    def keep_evicted(leaf, write_backs):
        seen.append(("keep_evicted", write_backs))
        return keep(leaf, write_backs)

    def finish_evict(write_backs):
        seen.append(("finish_evict", write_backs))
        return finish(write_backs)

    monkeypatch.setattr(tier, "begin_evict", begin_evict)
    monkeypatch.setattr(tier, "keep_evicted", keep_evicted)
    monkeypatch.setattr(tier, "finish_evict", finish_evict)
    return seen


def test_one_write_backs_object_goes_from_begin_evict_through_keep_evicted_to_finish_evict(monkeypatch):
    first, second = list(range(1, 9)), list(range(20, 28))
    kit = _kit_with([first, second], host_pages=8)
    tier = kit.cache._tier
    seen = _spy(monkeypatch, tier)

    freed = kit.cache.evict(16).tolist()

    assert [name for name, _ in seen] == ["begin_evict", "keep_evicted", "keep_evicted", "finish_evict"]
    write_backs = seen[0][1]
    assert isinstance(write_backs, WriteBacks) and all(obj is write_backs for _, obj in seen)
    assert write_backs.taken and len(write_backs) == 2 and tier._open is None  # the tier keeps no queue
    assert kit.cache.tier_stats().write_backs == 2 and kit.cache.host_size_info.evictable_size == 16
    kit.cache.check_integrity()
    # the copies were made: the bytes come back though the device pages were reused meanwhile
    kit.clobber(freed)
    for tokens in (first, second):
        handle, locations, host_len = kit.match_and_load(tokens, list(range(100, 108)))
        assert host_len == 8
        kit.check_content(tokens, locations, "a prefix written back by evict")
        kit.cache.lock_handle(handle, unlock=True)
        kit.cache.evict(8)  # gives the load's device pages 100..107 back (its host copy stays)


def test_a_node_dropped_later_in_the_same_evict_is_not_written_back():
    """One host page: the second leaf's move drops the first (just moved, least recent) and takes
    its host page, so only the second leaf's copy is made."""
    first, second = [1, 2, 3, 4], [9, 8, 7, 6]
    kit = _kit_with([first, second], host_pages=1)
    freed = kit.cache.evict(8).tolist()
    stats = kit.cache.tier_stats()
    assert stats.write_backs == 1 and stats.host_dropped_tokens == 4 and stats.host_free_pages == 0
    kit.cache.check_integrity()
    kit.clobber(freed)
    assert kit.cache.match_tiered(torch.tensor(first, dtype=torch.int32)).host_len == 0
    handle, locations, host_len = kit.match_and_load(second, list(range(100, 104)))
    assert host_len == 4
    kit.check_content(second, locations, "the leaf that kept the host page")


def test_write_backs_taken_twice_raise_and_change_nothing(monkeypatch):
    kit = _kit_with([list(range(1, 9))], host_pages=8)
    tier = kit.cache._tier
    seen = _spy(monkeypatch, tier)
    kit.cache.evict(8)
    write_backs = seen[0][1]
    before = _state(kit)
    with pytest.raises(DeferredWorkError, match="already taken"):
        tier.finish_evict(write_backs)
    with pytest.raises(DeferredWorkError, match="already taken"):
        write_backs.take()
    with pytest.raises(DeferredWorkError, match="already taken"):
        write_backs.add(seen[1][1], b"", None)
    assert _state(kit) == before and kit.cache.tier_stats().write_backs == 1
    kit.cache.check_integrity()


def test_write_backs_the_tier_did_not_hand_out_are_refused():
    kit = _kit_with([list(range(1, 9))], host_pages=8)
    tier = kit.cache._tier
    before = _state(kit)
    with pytest.raises(DeferredWorkError, match="did not hand out"):
        tier.finish_evict(WriteBacks())
    own = tier.begin_evict()
    leaf = kit.cache.match_prefix(torch.arange(1, 9, dtype=torch.int32)).handle
    with pytest.raises(DeferredWorkError, match="did not hand out"):
        tier.keep_evicted(leaf, WriteBacks())  # checked before the leaf or a host page is touched
    tier.finish_evict(own)
    assert _state(kit) == before
    kit.cache.check_integrity()


def test_dropped_write_backs_stop_the_next_evict_before_it_changes_anything():
    kit = _kit_with([list(range(1, 9))], host_pages=8)
    tier = kit.cache._tier
    dropped = tier.begin_evict()  # never handed back
    before = _state(kit)
    with pytest.raises(DeferredWorkError, match="never taken"):
        kit.cache.evict(8)
    assert _state(kit) == before
    with pytest.raises(AssertionError, match="never taken"):
        kit.cache.check_integrity()
    tier.finish_evict(dropped)  # handed back (empty): evicting works again
    assert kit.cache.evict(8).numel() == 8 and kit.cache.tier_stats().write_backs == 1
    kit.cache.check_integrity()


def test_write_backs_queued_before_an_evict_raises_are_still_made(monkeypatch):
    """``evict`` hands its queue back even when a later step of it raises: the leaves moved
    before are host-resident, so their copies must exist."""
    first, second = list(range(1, 9)), list(range(20, 28))
    kit = _kit_with([first, second], host_pages=8)
    tier = kit.cache._tier
    keep = tier.keep_evicted
    calls = []

    def keep_then_fail(leaf, write_backs):
        calls.append(leaf)
        if len(calls) == 2:
            raise RuntimeError("simulated failure inside evict")
        return keep(leaf, write_backs)

    monkeypatch.setattr(tier, "keep_evicted", keep_then_fail)
    with pytest.raises(RuntimeError, match="simulated"):
        kit.cache.evict(16)
    assert tier._open is None and kit.cache.tier_stats().write_backs == 1
