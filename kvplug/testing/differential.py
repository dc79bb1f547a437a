"""The randomised differential check: random operation lists against ``ReferencePrefixCache``.

After every operation the cache's answers, ``size_info`` and ``check_integrity()`` must agree with
the model. At the end every lock is released, every sequence the model holds must match with its
exact locations (oldest first, which keeps the recency order), and the cache is emptied one
``evict(1)`` at a time so that any recency the cache got wrong shows up as an LRU violation.
hypothesis is imported only here, when the check runs (``pip install 'hypothesis>=6.80'``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvplug.interface import BaseCacheHandle
from kvplug.testing.dependencies import require_hypothesis
from kvplug.testing.context import CheckContext, check_equal, check_location_tensor, check_sizes, expect_rejected
from kvplug.testing.model import ReferencePrefixCache

MAX_PAGES = 4
DEFAULT_EXAMPLES, SLOW_EXAMPLES = 50, 500
DEFAULT_OPERATIONS, SLOW_OPERATIONS = 30, 80

# An operation is (kind, page symbols, a free integer, a flag); repeats weight the kinds.
_KINDS = ("insert",) * 7 + ("match",) * 6 + ("unlock",) * 3 + ("evict",) * 4 + ("reset",)
Operation = tuple[str, list[int], int, bool]


@dataclass
class _Held:
    handle: BaseCacheHandle
    tokens: list[int]  # the locked (cached) prefix
    locations: list[int]


class DifferentialRun:
    """Applies operations to a cache and the model side by side, checking after each."""

    def __init__(self, ctx: CheckContext) -> None:
        self.ctx = ctx
        self.cache = ctx.new_cache()
        self.model = ReferencePrefixCache(ctx.page_size)
        self.held: list[_Held] = []
        self.next_location = 0

    def run(self, operations: Sequence[Operation]) -> None:
        for number, operation in enumerate(operations):
            description = self.describe(operation)
            try:
                self.apply(operation)
                check_sizes(self.cache, *self.model.sizes(), "size_info")
                self.cache.check_integrity()
            except AssertionError as error:
                raise AssertionError(f"operation #{number} {description}: {error}") from error
        try:
            self.check_everything_matches()
        except AssertionError as error:
            raise AssertionError(f"final check after {len(operations)} operations: {error}") from error

    def describe(self, operation: Operation) -> str:
        kind, pages, number, flag = operation
        return f"{kind}(pages={pages}, number={number}, flag={flag})"

    def apply(self, operation: Operation) -> None:
        kind, pages, number, flag = operation
        getattr(self, f"_{kind}")(pages, number, flag)

    def _insert(self, pages: list[int], _number: int, lock: bool) -> None:
        tokens = self.ctx.tokens(pages)
        locations = list(range(self.next_location, self.next_location + len(tokens)))
        self.next_location += len(tokens)
        result = self.cache.insert_prefix(self.ctx.tensor(tokens), self.ctx.tensor(locations))
        check_equal(result.cached_len, self.model.insert(tokens, locations), "insert_prefix cached_len")
        check_equal(result.handle.cached_len, len(tokens), "insert_prefix handle.cached_len")
        expected = self.model.locations(tokens)
        check_equal(self.ctx.indices_of(result.handle, "insert handle"), expected, "insert handle locations")
        if lock:
            self._lock(result.handle, tokens, expected)

    def _match(self, pages: list[int], tail: int, lock: bool) -> None:
        tail %= self.ctx.page_size
        tokens = self.ctx.tokens(pages) + self.ctx.page_tokens(0)[:tail]  # a partial page never matches
        handle = self.cache.match_prefix(self.ctx.tensor(tokens)).handle
        cached_len, expected = self.model.match(tokens)
        check_equal(handle.cached_len, cached_len, "match_prefix cached_len")
        check_equal(self.ctx.indices_of(handle, "match"), expected, "match_prefix locations")
        if lock:
            self._lock(handle, tokens[:cached_len], expected)

    def _lock(self, handle: BaseCacheHandle, tokens: list[int], locations: list[int]) -> None:
        self.cache.lock_handle(handle)
        self.model.lock(tokens, +1)
        self.held.append(_Held(handle, tokens, locations))

    def _unlock(self, _pages: list[int], index: int, _flag: bool) -> None:
        if not self.held:
            return
        held = self.held.pop(index % len(self.held))
        what = "a locked handle's get_matched_indices() (entries split since it was locked?)"
        check_equal(self.ctx.indices_of(held.handle, "locked handle"), held.locations, what)
        self.cache.lock_handle(held.handle, unlock=True)
        self.model.lock(held.tokens, -1)

    def _evict(self, _pages: list[int], number: int, small: bool) -> None:
        evictable = self.model.sizes()[0]
        if number % 10 == 0:
            too_many = evictable + 1
            expect_rejected(lambda: self.cache.evict(too_many), f"evict({too_many}) with {evictable} evictable")
            return
        # small requests free one entry or two, where LRU order shows; large ones cascade
        size = number % (min(evictable, 2 * self.ctx.page_size) + 1) if small else number % (evictable + 1)
        freed = self.cache.evict(size)
        check_location_tensor(freed, self.ctx.device, f"evict({size})")
        self.model.apply_eviction(freed.tolist(), size, lru=self.ctx.lru)

    def _reset(self, _pages: list[int], _number: int, _flag: bool) -> None:
        self.cache.reset()
        self.model.reset()
        self.held.clear()

    def check_everything_matches(self) -> None:
        """Unlock all; match every cached sequence, oldest first (which keeps the LRU order);
        then evict one page at a time, checking the LRU order at each step, until empty."""
        for held in reversed(self.held):
            self.cache.lock_handle(held.handle, unlock=True)
            self.model.lock(held.tokens, -1)
        self.held.clear()
        check_sizes(self.cache, *self.model.sizes(), "size_info after unlocking every handle")
        for key in sorted(self.model.leaf_keys(), key=lambda leaf: self.model.pages[leaf].last_access):
            handle = self.cache.match_prefix(self.ctx.tensor(key)).handle
            _, expected = self.model.match(key)
            check_equal(self.ctx.indices_of(handle, "final match"), expected, f"final match of cached tokens {key}")
        while self.model.pages:
            freed = self.cache.evict(1)
            self.model.apply_eviction(freed.tolist(), 1, lru=self.ctx.lru)
            check_sizes(self.cache, *self.model.sizes(), "size_info while evicting everything")
        self.cache.check_integrity()


def randomised_differential(ctx: CheckContext) -> None:
    """Random insert/match/lock/unlock/evict/reset sequences agree with a dict-based model."""
    require_hypothesis()  # a missing package is a KitDependencyError, never a failed check
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    symbols = st.integers(min_value=-1, max_value=2)  # -1: page 1 with a different last token
    operation = st.tuples(
        st.sampled_from(_KINDS),
        st.lists(symbols, min_size=1, max_size=MAX_PAGES),
        st.integers(min_value=0, max_value=1 << 12),
        st.booleans(),
    )
    max_operations = SLOW_OPERATIONS if ctx.slow else DEFAULT_OPERATIONS

    @settings(
        max_examples=SLOW_EXAMPLES if ctx.slow else DEFAULT_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=not ctx.slow,  # the default run is reproducible; --slow explores anew each time
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        phases=tuple(Phase) if ctx.shrink else tuple(phase for phase in Phase if phase is not Phase.shrink),
    )
    @given(st.lists(operation, min_size=max_operations // 3, max_size=max_operations))
    def differential(operations):
        DifferentialRun(ctx).run(operations)

    differential()
