"""``BackendStats``: a snapshot of what a ``KVBackend`` holds and how well its prefix cache works."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BackendStats:
    """Counters since the backend was created, and the pool's state now (all host-side ints).

    Attributes:
        queried_tokens: prompt tokens of every admitted request.
        cache_hit_tokens: of those, tokens found in the prefix cache (no recomputation).
        evicted_tokens: tokens the prefix cache evicted to make room.
        admitted_requests, finished_requests: lifetime counts.
        running_requests: live requests now.
        num_pages: pages of the pool (dummy page excluded).
        free_pages: pages in the free list.
        cached_pages: pages held by the prefix cache (evictable + protected).
        evictable_pages: cached pages no live request locks.
        used_pages: ``num_pages - free_pages`` (owned by requests or held by the cache).
    """

    queried_tokens: int
    cache_hit_tokens: int
    evicted_tokens: int
    admitted_requests: int
    finished_requests: int
    running_requests: int
    num_pages: int
    free_pages: int
    cached_pages: int
    evictable_pages: int
    used_pages: int

    @property
    def hit_rate(self) -> float:
        """``cache_hit_tokens / queried_tokens`` (0.0 before any admission)."""
        return self.cache_hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def utilisation(self) -> float:
        """``used_pages / num_pages``."""
        return self.used_pages / self.num_pages

    def to_json(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "utilisation": self.utilisation}
