"""Cache statistics across the kvplug caches transformers builds (one per batch processor).

A cache reports a ``kvplug.backend_stats.BackendStats`` snapshot after every step; a
``CacheRecord`` keeps the latest one (so counters survive the cache, which transformers drops when
``generate_batch`` returns) and ``HostStats`` sums the records.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from typing import Any, Iterable

# the store's reads for queued requests (issue 30, ``kvplug.TierStats``)
PREFETCH = ("remote_prefetches", "remote_prefetch_hit_tokens", "remote_prefetch_timeouts", "remote_prefetch_dropped",
            "remote_blocking_reads")
COUNTERS = ("queried_tokens", "cache_hit_tokens", "evicted_tokens", "admitted_requests", "finished_requests",
            "host_hit_tokens", "host_loads", "host_loaded_bytes", "host_write_backs", "host_written_bytes",
            "host_dropped_tokens", "host_reused_copy_tokens", "host_copy_failures",
            "remote_hit_tokens", "remote_written_pages", "remote_dropped_pages", "remote_corrupt_pages",
            "remote_errors", "remote_queued_pages", *PREFETCH)
POOL_FIELDS = ("running_requests", "num_pages", "free_pages", "cached_pages", "evictable_pages", "used_pages",
               "host_pages", "host_free_pages")
# host-tier fields of HostStats -> keys of BackendStats.tier (``kvplug.interface.TierStats``)
TIER_FIELDS = {"host_loads": "loads", "host_loaded_bytes": "loaded_bytes", "host_write_backs": "write_backs",
               "host_written_bytes": "written_bytes", "host_dropped_tokens": "host_dropped_tokens",
               "host_reused_copy_tokens": "reused_copy_tokens",
               "host_copy_failures": "copy_failures", "host_pages": "host_pages",
               "host_free_pages": "host_free_pages",
               **{name: name for name in ("remote_hit_tokens", "remote_written_pages", "remote_dropped_pages",
                                          "remote_corrupt_pages", "remote_errors", "remote_queued_pages",
                                          *PREFETCH)}}  # issue 30


def _field(stats: Any, name: str) -> int:
    """``name`` of a ``BackendStats``, host-tier fields read from its ``tier`` (0 without a tier)."""
    key = TIER_FIELDS.get(name)
    if key is None:
        return getattr(stats, name, 0)
    tier = getattr(stats, "tier", None)
    return tier[key] if tier else 0


class CacheRecord:
    """The latest statistics of one kvplug cache (updated from the generation thread)."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.latest: Any = None
        self.plan: Any = None
        self.attention: str | None = None
        self._baseline: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._cache: weakref.ref | None = None

    def attach(self, cache: Any) -> None:
        self._cache = weakref.ref(cache)
        self.plan = cache.plan
        self.attention = cache.backend.attention_name
        self.latest = cache.stats()

    def update(self, stats: Any) -> None:
        self.latest = stats  # one reference swap: readers on other threads see old or new, whole

    @property
    def alive(self) -> bool:
        return self._cache is not None and self._cache() is not None

    @property
    def cache(self) -> Any:
        """The ``KVPlugPagedCache``, ``None`` once it is gone."""
        return None if self._cache is None else self._cache()

    def rebase(self) -> None:
        """Count from zero again (``TransformersHost.reset_stats``)."""
        if self.latest is not None:
            self._baseline = {name: _field(self.latest, name) for name in COUNTERS}

    def counters(self) -> dict[str, int]:
        if self.latest is None:
            return dict.fromkeys(COUNTERS, 0)
        return {name: _field(self.latest, name) - self._baseline[name] for name in COUNTERS}


@dataclass(frozen=True)
class HostStats:
    """kvplug statistics of a transformers host.

    Attributes:
        caches: kvplug caches built (one per continuous-batching processor), live ones in ``live_caches``.
        queried_tokens: prompt tokens admitted; ``cache_hit_tokens`` of them came from the prefix cache.
        evicted_tokens: tokens the prefix cache evicted to make room.
        admitted_requests, finished_requests: request counts.
        running_requests, num_pages, free_pages, cached_pages, evictable_pages, used_pages: the
            live caches' pools now (summed).
        prefix_cache, attention: names in use by the most recent cache (``None`` before any).
        host_hit_tokens: of ``cache_hit_tokens``, tokens loaded from the host-memory tier.
        host_loads, host_loaded_bytes, host_write_backs, host_written_bytes: copies host -> device
            (hits) and device -> host (evicted prefixes kept), and their bytes.
        host_dropped_tokens, host_copy_failures: tokens the full host tier dropped; failed copies.
        host_reused_copy_tokens: evicted tokens that needed no write-back (a loaded prefix keeps
            its host copy).
        host_pages, host_free_pages: the live caches' host tiers now (0 without a tier).
        remote_hit_tokens, remote_written_pages, remote_dropped_pages, remote_corrupt_pages,
            remote_errors, remote_queued_pages: the shared KV store under the host tier
            (``--remote-kv``, issue 30; see ``kvplug.TierStats``).
        remote_prefetches, remote_prefetch_hit_tokens, remote_prefetch_timeouts,
            remote_prefetch_dropped, remote_blocking_reads: its reads for queued requests (see
            ``kvplug.TierStats``).
        cache_guard: the most recent cache's prefix-cache health (``BackendStats.prefix_cache``:
            faults of an untrusted plugin, the policy, whether it stopped), or ``None``.
    """

    caches: int
    live_caches: int
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
    prefix_cache: str | None
    attention: str | None
    host_hit_tokens: int = 0
    host_loads: int = 0
    host_loaded_bytes: int = 0
    host_write_backs: int = 0
    host_written_bytes: int = 0
    host_dropped_tokens: int = 0
    host_reused_copy_tokens: int = 0
    host_copy_failures: int = 0
    host_pages: int = 0
    host_free_pages: int = 0
    remote_hit_tokens: int = 0
    remote_written_pages: int = 0
    remote_dropped_pages: int = 0
    remote_corrupt_pages: int = 0
    remote_errors: int = 0
    remote_queued_pages: int = 0
    remote_prefetches: int = 0
    remote_prefetch_hit_tokens: int = 0
    remote_prefetch_timeouts: int = 0
    remote_prefetch_dropped: int = 0
    remote_blocking_reads: int = 0
    cache_guard: dict | None = None

    @property
    def hit_rate(self) -> float:
        return self.cache_hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def device_hit_rate(self) -> float:
        """Prompt tokens found in the device tier over prompt tokens."""
        hits = self.cache_hit_tokens - self.host_hit_tokens
        return hits / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        """Prompt tokens loaded from the host-memory tier over prompt tokens."""
        return self.host_hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def utilisation(self) -> float:
        """Used pages over pages, across live caches (0.0 when none is alive)."""
        return self.used_pages / self.num_pages if self.num_pages else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "device_hit_rate": self.device_hit_rate,
                "host_hit_rate": self.host_hit_rate, "utilisation": self.utilisation}

    def describe(self) -> str:
        totals = (
            f"kvplug cache: {self.cache_hit_tokens:,}/{self.queried_tokens:,} prompt tokens hit "
            f"({self.hit_rate:.1%}), {self.evicted_tokens:,} tokens evicted, "
        )
        if self.host_pages or self.host_write_backs:
            totals += (
                f"host tier: {self.host_hit_tokens:,} tokens loaded ({self.host_hit_rate:.1%}), "
                f"{self.host_loaded_bytes / 2**20:,.1f} MiB in / {self.host_written_bytes / 2**20:,.1f} MiB out, "
            )
        if not self.live_caches:  # pools are released when the manager stops: no utilisation to show
            return totals + f"no live pool, {self.finished_requests:,} finished"
        return totals + (
            f"utilisation {self.utilisation:.1%} ({self.used_pages:,}/{self.num_pages:,} pages, "
            f"{self.cached_pages:,} cached), {self.running_requests} running, {self.finished_requests:,} finished"
        )

    @classmethod
    def combine(cls, records: Iterable[CacheRecord]) -> "HostStats":
        records = list(records)
        totals = dict.fromkeys(COUNTERS, 0)
        pool = dict.fromkeys(POOL_FIELDS, 0)
        live = 0
        for record in records:
            for name, value in record.counters().items():
                totals[name] += value
            if record.alive and record.latest is not None:
                live += 1
                for name in POOL_FIELDS:
                    pool[name] += _field(record.latest, name)
        last = records[-1] if records else None
        return cls(
            caches=len(records),
            live_caches=live,
            **totals,
            **pool,
            prefix_cache=last.settings.prefix_cache if last else None,
            attention=last.attention if last else None,
            cache_guard=getattr(last.latest, "prefix_cache", None) if last is not None else None,
        )
