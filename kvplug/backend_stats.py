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
        host_hit_tokens: of ``cache_hit_tokens``, tokens loaded from the host-memory tier (0
            without one); ``cache_hit_tokens - host_hit_tokens`` were found on the device.
        tier: the host tier's counters (``kvplug.interface.TierStats.as_dict()``: host pages, loads,
            write-backs, bytes moved, drops, copy failures), ``None`` without a tier.
        prefix_cache: the prefix cache's health (``kvplug.cache_guard.CacheGuard.as_dict()``): its
            name now, ``cache_failures`` (faults of an untrusted cache, each replaced it),
            ``last_cache_fault`` (a message or ``None``), ``on_cache_failure``, ``stopped``.
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
    host_hit_tokens: int = 0
    tier: dict | None = None
    prefix_cache: dict | None = None

    @property
    def hit_rate(self) -> float:
        """``cache_hit_tokens / queried_tokens`` (0.0 before any admission)."""
        return self.cache_hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def device_hit_tokens(self) -> int:
        return self.cache_hit_tokens - self.host_hit_tokens

    @property
    def device_hit_rate(self) -> float:
        """Hit rate of the device tier alone: ``device_hit_tokens / queried_tokens``."""
        return self.device_hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        """Hit rate of the host tier: ``host_hit_tokens / queried_tokens``."""
        return self.host_hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def utilisation(self) -> float:
        """``used_pages / num_pages``."""
        return self.used_pages / self.num_pages

    def to_json(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "device_hit_rate": self.device_hit_rate,
                "host_hit_rate": self.host_hit_rate, "utilisation": self.utilisation}
