"""Conformance checks about what a prefix cache stores and matches.

Each check takes a ``CheckContext``, builds fresh caches from its factory and raises
``AssertionError`` saying what was expected and what came back. Locations are arbitrary distinct
int32 values: a cache must hand back exactly what it was given, never compute locations itself.
"""

from __future__ import annotations

from kvplug.testing.context import CheckContext, check_equal, check_sizes, expect_rejected


def match_returns_inserted_values(ctx: CheckContext) -> None:
    """Match hands back exactly the inserted locations, truncated to whole pages."""
    P = ctx.page_size
    cache = ctx.new_cache()
    tokens = ctx.tokens([1, 2, 3])
    locations = [5000 - 3 * i for i in range(len(tokens))]  # not contiguous, not sorted
    inserted = cache.insert_prefix(ctx.tensor(tokens), ctx.tensor(locations))
    check_equal(inserted.cached_len, 0, "insert into an empty cache: cached_len")
    for queried, expected_len in ((tokens, 3 * P), (tokens + [7] * (P - 1), 3 * P), (tokens[: 2 * P + P // 2], 2 * P)):
        handle = cache.match_prefix(ctx.tensor(queried)).handle
        assert handle.cached_len or cache.size_info.total_size, (
            "the cache kept nothing of an insert; if it keeps nothing by design, run the kit with keeps_entries=False"
        )
        check_equal(handle.cached_len, expected_len, f"match of {len(queried)} tokens: cached_len")
        check_equal(ctx.indices_of(handle, "match"), locations[:expected_len], "match: locations")
    check_sizes(cache, 3 * P, 0, "after one insert")
    cache.check_integrity()


def empty_and_unknown_keys_match_nothing(ctx: CheckContext) -> None:
    """Empty inputs, inputs shorter than a page and unknown first pages match 0 tokens."""
    P = ctx.page_size
    cache = ctx.new_cache()
    for queried in ([], ctx.tokens([1]), ctx.tokens([1])[: P - 1]):
        check_equal(cache.match_prefix(ctx.tensor(queried)).handle.cached_len, 0, f"empty cache, match {queried}")
    tokens = ctx.tokens([1, 2])
    cache.insert_prefix(ctx.tensor(tokens), ctx.tensor(range(100, 100 + 2 * P)))
    for what, queried in (
        ("empty input", []),
        ("input shorter than a page", tokens[: P - 1]),
        ("unknown first page", ctx.tokens([3, 2])),
        ("first page differing in its last token", ctx.tokens([-1, 2])),
    ):
        handle = cache.match_prefix(ctx.tensor(queried)).handle
        check_equal(handle.cached_len, 0, f"match of {what}: cached_len")
        check_equal(ctx.indices_of(handle, f"match of {what}"), [], f"match of {what}: locations")
    cache.check_integrity()


def split_keeps_values_and_sizes(ctx: CheckContext) -> None:
    """Diverging inserts and partial matches (which split entries) keep every value and size exact."""
    P = ctx.page_size
    cache = ctx.new_cache()
    first, second = ctx.tokens([1, 2, 3, 4]), ctx.tokens([1, 2, 5])
    first_locations, second_locations = list(range(10, 10 + 4 * P)), list(range(500, 500 + 3 * P))
    cache.insert_prefix(ctx.tensor(first), ctx.tensor(first_locations))
    result = cache.insert_prefix(ctx.tensor(second), ctx.tensor(second_locations))
    check_equal(result.cached_len, 2 * P, "insert diverging after 2 pages: cached_len")
    check_sizes(cache, 5 * P, 0, "after a diverging insert")
    cache.check_integrity()
    expected = {
        "first": (first, first_locations),
        "second": (second, first_locations[: 2 * P] + second_locations[2 * P :]),
        "first 3 pages": (first[: 3 * P], first_locations[: 3 * P]),  # splits the first entry's tail
        "first page": (first[:P], first_locations[:P]),
        "mismatch inside page 3": (ctx.tokens([1, 2, -3]), first_locations[: 2 * P]),
    }
    for _ in range(2):  # the second round runs on the split tree
        for what, (queried, locations) in expected.items():
            handle = cache.match_prefix(ctx.tensor(queried)).handle
            check_equal(ctx.indices_of(handle, f"match {what}"), locations, f"match {what}: locations")
            cache.check_integrity()
    check_sizes(cache, 5 * P, 0, "after splitting matches")


def duplicate_insert_reports_cached_len(ctx: CheckContext) -> None:
    """Re-inserting cached tokens reports them as cached and keeps the first copy's locations."""
    P = ctx.page_size
    cache = ctx.new_cache()
    tokens = ctx.tokens([1, 2, 3])
    original = list(range(300, 300 + 3 * P))
    cache.insert_prefix(ctx.tensor(tokens), ctx.tensor(original))
    again = cache.insert_prefix(ctx.tensor(tokens), ctx.tensor(range(900, 900 + 3 * P)))
    check_equal(again.cached_len, 3 * P, "insert of the same tokens again: cached_len")
    check_equal(again.handle.cached_len, 3 * P, "insert handle: cached_len")
    check_equal(ctx.indices_of(again.handle, "duplicate insert handle"), original, "duplicate insert: locations")
    shorter = cache.insert_prefix(ctx.tensor(tokens[: 2 * P]), ctx.tensor(range(700, 700 + 2 * P)))
    check_equal(shorter.cached_len, 2 * P, "insert of a cached prefix: cached_len")
    check_sizes(cache, 3 * P, 0, "duplicate inserts must not grow the cache")
    longer = cache.insert_prefix(ctx.tensor(ctx.tokens([1, 2, 3, 4])), ctx.tensor(range(600, 600 + 4 * P)))
    check_equal(longer.cached_len, 3 * P, "insert extending a cached sequence: cached_len")
    check_sizes(cache, 4 * P, 0, "after extending by one page")
    handle = cache.match_prefix(ctx.tensor(ctx.tokens([1, 2, 3, 4]))).handle
    check_equal(ctx.indices_of(handle, "match"), original + list(range(600 + 3 * P, 600 + 4 * P)), "locations")
    cache.check_integrity()


def lengths_are_page_multiples(ctx: CheckContext) -> None:
    """Every cached_len is a multiple of the page size; evict frees whole pages."""
    P = ctx.page_size
    cache = ctx.new_cache()
    tokens = ctx.tokens([1, 2, 3])
    cache.insert_prefix(ctx.tensor(tokens), ctx.tensor(range(40, 40 + 3 * P)))
    for length in range(len(tokens) + 1):
        handle = cache.match_prefix(ctx.tensor(tokens[:length])).handle
        expected = length // P * P if ctx.keeps_entries else 0
        check_equal(handle.cached_len, expected, f"match of {length} tokens: cached_len")
    if ctx.keeps_entries:
        freed = cache.evict(1)
        assert freed.shape[0] % P == 0, f"evict(1) freed {freed.shape[0]} locations, not whole pages of {P}"
    info = cache.size_info
    for name, value in (("evictable_size", info.evictable_size), ("protected_size", info.protected_size)):
        assert value % P == 0, f"size_info.{name} = {value} is not a multiple of the page size {P}"
    cache.check_integrity()


def bad_input_is_rejected(ctx: CheckContext) -> None:
    """Malformed inserts (negative or repeated locations too) and evict sizes raise and change
    nothing (docs/design.md, section 8)."""
    P = ctx.page_size
    cache = ctx.new_cache()
    tokens = ctx.tokens([1, 2])
    cache.insert_prefix(ctx.tensor(tokens), ctx.tensor(range(10, 10 + 2 * P)))
    before = tuple(cache.size_info)
    other = ctx.tokens([3, 4])
    bad_inserts = {
        "lengths differ": (ctx.tensor(other), ctx.tensor(range(50, 50 + 2 * P - 1))),
        "int64 token ids": (ctx.tensor(other).long(), ctx.tensor(range(50, 50 + 2 * P))),
        "int64 locations": (ctx.tensor(other), ctx.tensor(range(50, 50 + 2 * P)).long()),
        "2-D token ids": (ctx.tensor(other).view(1, -1), ctx.tensor(range(50, 50 + 2 * P)).view(1, -1)),
    }
    repeated = list(range(50, 50 + 2 * P))
    repeated[-1] = repeated[0]
    bad_inserts["a negative location"] = (ctx.tensor(other), ctx.tensor([-1] + list(range(51, 50 + 2 * P))))
    bad_inserts["a location given twice"] = (ctx.tensor(other), ctx.tensor(repeated))
    if P > 1:
        bad_inserts["length not a page multiple"] = (ctx.tensor(other[:-1]), ctx.tensor(range(50, 49 + 2 * P)))
    for what, (ids, locations) in bad_inserts.items():
        expect_rejected(lambda: cache.insert_prefix(ids, locations), f"insert_prefix with {what}")
        check_equal(tuple(cache.size_info), before, f"size_info after a rejected insert ({what})")
        cache.check_integrity()
    expect_rejected(lambda: cache.match_prefix(ctx.tensor(tokens).long()), "match_prefix with int64 token ids")
    for size in (-1, None, "3", 0.0, 1.5, True):
        expect_rejected(lambda: cache.evict(size), f"evict({size!r})")
        check_equal(tuple(cache.size_info), before, f"size_info after a rejected evict({size!r})")
    if ctx.keeps_entries:
        handle = cache.match_prefix(ctx.tensor(tokens)).handle
        check_equal(handle.cached_len, 2 * P, "the entry cached before the rejected calls: cached_len")
    check_equal(cache.match_prefix(ctx.tensor(other)).handle.cached_len, 0, "a rejected insert must cache nothing")
