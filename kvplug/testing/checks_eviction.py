"""Conformance checks about locks, eviction and reset (see ``checks_entries`` for the conventions)."""

from __future__ import annotations

from kvplug.testing.context import CheckContext, check_equal, check_location_tensor, check_sizes, expect_rejected


def locks_nest_and_protect_entries(ctx: CheckContext) -> None:
    """Locks nest per handle and along the path; locked entries are never evicted."""
    P = ctx.page_size
    cache = ctx.new_cache()
    first, second = ctx.tokens([1, 2, 3]), ctx.tokens([1, 2, 4])
    first_locations, second_locations = list(range(100, 100 + 3 * P)), list(range(200, 200 + 3 * P))
    cache.insert_prefix(ctx.tensor(first), ctx.tensor(first_locations))
    cache.insert_prefix(ctx.tensor(second), ctx.tensor(second_locations))
    outer = cache.match_prefix(ctx.tensor(first)).handle
    cache.lock_handle(outer)
    cache.lock_handle(outer)
    check_sizes(cache, P, 3 * P, "first sequence locked twice")
    expect_rejected(lambda: cache.evict(2 * P), "evict() of more than the unlocked tokens")
    check_sizes(cache, P, 3 * P, "after a rejected evict")
    freed = cache.evict(P)
    check_equal(sorted(freed.tolist()), second_locations[2 * P :], "evict() with the first sequence locked")
    cache.lock_handle(outer, unlock=True)
    check_sizes(cache, 0, 3 * P, "one of two nested locks released")
    inner = cache.match_prefix(ctx.tensor(first[: 2 * P])).handle
    cache.lock_handle(inner)
    cache.lock_handle(outer, unlock=True)
    check_sizes(cache, P, 2 * P, "outer handle released, its first two pages locked by another handle")
    check_equal(sorted(cache.evict(P).tolist()), first_locations[2 * P :], "evict() around a locked prefix")
    expect_rejected(lambda: cache.evict(1), "evict() while every entry is locked")
    check_equal(ctx.indices_of(inner, "locked handle"), first_locations[: 2 * P], "locked handle: locations")
    cache.lock_handle(inner, unlock=True)
    check_sizes(cache, 2 * P, 0, "every lock released")
    check_equal(sorted(cache.evict(2 * P).tolist()), first_locations[: 2 * P], "evict() after unlocking")
    inserted = cache.insert_prefix(ctx.tensor(second), ctx.tensor(second_locations)).handle
    cache.lock_handle(inserted)  # handles from insert_prefix lock like those from match_prefix
    check_sizes(cache, 0, 3 * P, "inserted handle locked")
    expect_rejected(lambda: cache.evict(P), "evict() of a locked inserted entry")
    cache.lock_handle(inserted, unlock=True)
    cache.check_integrity()


def evict_zero_is_a_noop(ctx: CheckContext) -> None:
    """``evict(0)`` returns an empty int32 tensor and changes nothing, on empty and full caches."""
    P = ctx.page_size
    cache = ctx.new_cache()
    for state in ("empty", "holding one sequence"):
        before = tuple(cache.size_info)
        freed = cache.evict(0)
        check_location_tensor(freed, ctx.device, f"evict(0) on an {state} cache")
        check_equal(freed.shape[0], 0, f"evict(0) on a cache {state}: freed locations")
        check_equal(tuple(cache.size_info), before, f"size_info after evict(0) on a cache {state}")
        cache.check_integrity()
        cache.insert_prefix(ctx.tensor(ctx.tokens([1, 2])), ctx.tensor(range(30, 30 + 2 * P)))
    expected = 2 * P if ctx.keeps_entries else 0
    check_equal(cache.match_prefix(ctx.tensor(ctx.tokens([1, 2]))).handle.cached_len, expected, "match after evict(0)")


def evict_beyond_evictable_raises(ctx: CheckContext) -> None:
    """Asking for more than the evictable size raises and evicts nothing."""
    P = ctx.page_size
    cache = ctx.new_cache()
    expect_rejected(lambda: cache.evict(1), "evict(1) on an empty cache")
    tokens = ctx.tokens([1, 2, 3])
    cache.insert_prefix(ctx.tensor(tokens), ctx.tensor(range(1000, 1000 + 3 * P)))
    cache.insert_prefix(ctx.tensor(ctx.tokens([4])), ctx.tensor(range(2000, 2000 + P)))
    before = tuple(cache.size_info)
    expect_rejected(lambda: cache.evict(before[0] + 1), f"evict({before[0] + 1}) with {before[0]} evictable")
    check_equal(tuple(cache.size_info), before, "size_info after a rejected evict")
    expected = 3 * P if ctx.keeps_entries else 0
    check_equal(cache.match_prefix(ctx.tensor(tokens)).handle.cached_len, expected, "match after a rejected evict")
    cache.check_integrity()


def eviction_is_least_recently_used_first(ctx: CheckContext) -> None:
    """Entries are evicted oldest first, where a match makes an entry the newest."""
    P = ctx.page_size
    cache = ctx.new_cache()
    locations = {}
    for index, name in enumerate("ABC"):
        locations[name] = set(range(1000 * (index + 1), 1000 * (index + 1) + 2 * P))
        cache.insert_prefix(ctx.tensor(ctx.tokens([index + 1] * 2)), ctx.tensor(sorted(locations[name])))
    cache.match_prefix(ctx.tensor(ctx.tokens([1, 1])))  # A becomes the most recently used
    order = ["B", "C", "A"]
    while cache.size_info.evictable_size:
        freed = set(cache.evict(1).tolist())
        oldest = next(name for name in order if locations[name])
        assert freed <= locations[oldest], (
            f"evict(1) freed {sorted(freed)} but the least recently used entry was {oldest} "
            f"(inserted A, B, C, then matched A), holding {sorted(locations[oldest])}"
        )
        locations[oldest] -= freed
    cache.check_integrity()


def evicted_prefix_no_longer_matches(ctx: CheckContext) -> None:
    """After evict, matches never return freed locations; after evicting all, nothing matches."""
    P = ctx.page_size
    cache = ctx.new_cache()
    sequences = {"A": ctx.tokens([1, 2, 3]), "B": ctx.tokens([1, 2, 4]), "C": ctx.tokens([5])}
    cached = {}
    for index, (name, tokens) in enumerate(sequences.items()):
        locations = list(range(100 * (index + 1), 100 * (index + 1) + len(tokens)))
        cache.insert_prefix(ctx.tensor(tokens), ctx.tensor(locations))
        cached[name] = cache.match_prefix(ctx.tensor(tokens)).handle.get_matched_indices().tolist()
    every_location = {location for locations in cached.values() for location in locations}
    freed_so_far: set[int] = set()
    while cache.size_info.evictable_size:
        freed = set(cache.evict(P).tolist())
        assert not freed & freed_so_far, f"evict() returned already freed locations {sorted(freed & freed_so_far)}"
        freed_so_far |= freed
        for name, tokens in sequences.items():
            handle = cache.match_prefix(ctx.tensor(tokens)).handle
            matched = ctx.indices_of(handle, f"match {name} after evict")
            check_equal(matched, cached[name][: handle.cached_len], f"match {name} after evict: locations")
            assert not set(matched) & freed_so_far, f"match {name} returned freed locations"
        cache.check_integrity()
    check_equal(freed_so_far, every_location, "evicting everything must free every cached location")
    for name, tokens in sequences.items():
        check_equal(cache.match_prefix(ctx.tensor(tokens)).handle.cached_len, 0, f"match {name} in an emptied cache")


def reset_forgets_everything(ctx: CheckContext) -> None:
    """``reset()`` empties the cache, locks included; it is usable again afterwards."""
    P = ctx.page_size
    cache = ctx.new_cache()
    tokens = ctx.tokens([1, 2])
    cache.insert_prefix(ctx.tensor(tokens), ctx.tensor(range(10, 10 + 2 * P)))
    cache.insert_prefix(ctx.tensor(ctx.tokens([3])), ctx.tensor(range(50, 50 + P)))
    cache.lock_handle(cache.match_prefix(ctx.tensor(tokens)).handle)
    cache.reset()
    check_sizes(cache, 0, 0, "after reset()")
    check_equal(cache.match_prefix(ctx.tensor(tokens)).handle.cached_len, 0, "match after reset()")
    check_equal(cache.evict(0).shape[0], 0, "evict(0) after reset()")
    expect_rejected(lambda: cache.evict(1), "evict(1) after reset()")
    cache.check_integrity()
    again = cache.insert_prefix(ctx.tensor(tokens), ctx.tensor(range(70, 70 + 2 * P)))
    check_equal(again.cached_len, 0, "insert after reset(): cached_len")
    if ctx.keeps_entries:
        handle = cache.match_prefix(ctx.tensor(tokens)).handle
        check_equal(ctx.indices_of(handle, "match after reset()"), list(range(70, 70 + 2 * P)), "locations")
    cache.check_integrity()


def keeps_nothing(ctx: CheckContext) -> None:
    """A cache that keeps nothing: inserts report 0 cached, matches find 0, sizes stay 0."""
    P = ctx.page_size
    cache = ctx.new_cache()
    tokens = ctx.tokens([1, 2])
    for attempt in ("first", "second"):
        inserted = cache.insert_prefix(ctx.tensor(tokens), ctx.tensor(range(10, 10 + 2 * P)))
        check_equal(inserted.cached_len, 0, f"{attempt} insert: cached_len")
        ctx.indices_of(inserted.handle, f"{attempt} insert handle")
        matched = cache.match_prefix(ctx.tensor(tokens)).handle
        check_equal(matched.cached_len, 0, f"match after the {attempt} insert: cached_len")
        check_equal(ctx.indices_of(matched, "match"), [], "match: locations")
        cache.lock_handle(matched)
        check_sizes(cache, 0, 0, f"after the {attempt} insert and a lock")
        cache.lock_handle(matched, unlock=True)
        cache.check_integrity()
