"""``ReferencePrefixCache``: the obviously-correct model the differential check compares against.

One dict entry per cached page, keyed by every token id from the start of the sequence to the end
of that page, so "the prefix is cached" is a chain of dict lookups and nothing is shared or split.
It models what the contract fixes and nothing an implementation may choose:

- ``match`` returns the longest cached run of whole pages, refreshing those pages' recency;
- ``insert`` reports how many leading tokens were cached, adds the rest, and refreshes every page
  of the inserted sequence (a parent is therefore never older than its extensions);
- which entries ``evict`` frees is the implementation's choice (a radix tree frees whole nodes),
  so the model does not predict it: ``apply_eviction`` takes the freed locations and asserts they
  are legal (whole unlocked pages; at least the requested count, overshooting by less than the
  longest cached sequence; extensions go with their prefix; with ``lru``, nothing freed is newer
  than an unlocked leaf that was kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Tokens = tuple[int, ...]


@dataclass
class ModelPage:
    """One cached page: its locations, the clock of its last use, and how many locks cover it."""

    locations: tuple[int, ...]
    last_access: int
    lock_count: int = 0


class ReferencePrefixCache:
    """Dict-based model of a page-granular LRU prefix cache."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[Tokens, ModelPage] = {}
        self.clock = 0

    def _page_keys(self, tokens: Sequence[int]) -> list[Tokens]:
        tokens = tuple(tokens)
        return [tokens[:end] for end in range(self.page_size, len(tokens) + 1, self.page_size)]

    def _cached_keys(self, tokens: Sequence[int]) -> list[Tokens]:
        cached = []
        for key in self._page_keys(tokens):
            if key not in self.pages:
                break
            cached.append(key)
        return cached

    def cached_len(self, tokens: Sequence[int]) -> int:
        """Length of the cached page-aligned prefix of ``tokens``; refreshes nothing."""
        return len(self._cached_keys(tokens)) * self.page_size

    def locations(self, tokens: Sequence[int]) -> list[int]:
        """Locations of the cached prefix of ``tokens``; refreshes nothing."""
        return [location for key in self._cached_keys(tokens) for location in self.pages[key].locations]

    def match(self, tokens: Sequence[int]) -> tuple[int, list[int]]:
        """``match_prefix``: the cached length and its locations; refreshes the matched pages."""
        keys = self._cached_keys(tokens)
        self.clock += 1
        for key in keys:
            self.pages[key].last_access = self.clock
        return len(keys) * self.page_size, [location for key in keys for location in self.pages[key].locations]

    def insert(self, tokens: Sequence[int], locations: Sequence[int]) -> int:
        """``insert_prefix``: returns the previously cached length; refreshes every inserted page."""
        assert len(tokens) == len(locations) and len(tokens) % self.page_size == 0
        cached = self.cached_len(tokens)
        self.clock += 1
        for index, key in enumerate(self._page_keys(tokens)):
            page = self.pages.get(key)
            if page is None:
                start = index * self.page_size
                page = self.pages[key] = ModelPage(tuple(locations[start : start + self.page_size]), self.clock)
            page.last_access = self.clock
        return cached

    def lock(self, tokens: Sequence[int], delta: int) -> None:
        """Add ``delta`` (+1 lock, -1 unlock) to every page of the cached prefix ``tokens``."""
        for key in self._page_keys(tokens):
            page = self.pages[key]
            page.lock_count += delta
            assert page.lock_count >= 0, f"model: unlocked {key} more often than it was locked"

    def sizes(self) -> tuple[int, int]:
        """``(evictable, protected)`` token counts."""
        protected = sum(1 for page in self.pages.values() if page.lock_count) * self.page_size
        return len(self.pages) * self.page_size - protected, protected

    def leaf_keys(self) -> list[Tokens]:
        """Cached pages that no cached page extends."""
        parents = {key[: -self.page_size] for key in self.pages}
        return [key for key in self.pages if key not in parents]

    def reset(self) -> None:
        self.pages.clear()

    def apply_eviction(self, freed: Sequence[int], requested: int, lru: bool = True) -> None:
        """Check that ``freed`` (what ``evict(requested)`` returned) is legal, then forget those pages."""
        freed = list(freed)
        assert len(freed) >= requested, f"evict({requested}) freed only {len(freed)} locations"
        # whole entries may overshoot, but never by a whole cached sequence (and evict(0) frees nothing)
        longest = max(map(len, self.pages), default=0)
        assert len(freed) == 0 if requested == 0 else len(freed) < requested + longest, (
            f"evict({requested}) freed {len(freed)} locations; the longest cached sequence has {longest} tokens"
        )
        assert len(set(freed)) == len(freed), f"evict({requested}) returned a location twice: {sorted(freed)}"
        owner = {location: key for key, page in self.pages.items() for location in page.locations}
        unknown = sorted(location for location in freed if location not in owner)
        assert not unknown, f"evict({requested}) returned locations never cached (or already freed): {unknown}"
        freed_set = set(freed)
        evicted = {owner[location] for location in freed}
        for key in evicted:
            page = self.pages[key]
            assert freed_set.issuperset(page.locations), (
                f"evict({requested}) freed part of a page: {sorted(freed_set & set(page.locations))} "
                f"of {list(page.locations)}"
            )
            assert page.lock_count == 0, f"evict({requested}) freed a locked entry (locations {list(page.locations)})"
        kept = {key: page for key, page in self.pages.items() if key not in evicted}
        for key in kept:
            parent = key[: -self.page_size]
            assert not parent or parent in kept, (
                f"evict({requested}) freed a prefix but kept its extension (locations {list(kept[key].locations)})"
            )
        if lru and evicted:
            self._check_least_recently_used(evicted, kept, requested)
        for key in evicted:
            del self.pages[key]

    def _check_least_recently_used(self, evicted: set[Tokens], kept: dict[Tokens, ModelPage], requested: int) -> None:
        parents = {key[: -self.page_size] for key in kept}
        unlocked_leaves = [page for key, page in kept.items() if key not in parents and not page.lock_count]
        if not unlocked_leaves:
            return
        newest_evicted = max(self.pages[key].last_access for key in evicted)
        oldest_kept = min(unlocked_leaves, key=lambda page: page.last_access)
        assert newest_evicted <= oldest_kept.last_access, (
            f"evict({requested}) is not least-recently-used first: it freed an entry used at tick "
            f"{newest_evicted} but kept the unlocked entry {list(oldest_kept.locations)} last used at tick "
            f"{oldest_kept.last_access}"
        )
