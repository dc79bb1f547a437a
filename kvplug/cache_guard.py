"""``CacheGuard``: a prefix cache that faults is quarantined and replaced; the backend keeps serving.

A ``PrefixCacheFault`` (``kvplug.prefix_cache.checked``: the plugin raised, or answered outside
the contract) reaches the backend before it used the answer, and every lifecycle call changes
nothing before its cache calls succeeded, so the backend is whole when the fault arrives. The
guard then, by ``on_cache_failure``:

- ``"fallback"`` (default): hands the pool over to a new cache (``hand_over``) and lets the call
  run again on it (``kvplug.call_gate.backend_call``). The new cache is the fallback (``naive`` by
  default; a registered name, or the failing cache's own name for a fresh instance of the same
  factory); if that one faults too, ``naive``, which cannot. No request is failed: the call that met
  the fault succeeds on the new cache, and requests holding locked matches of the faulty cache keep
  running on the same pages (their K/V is intact: the cache only indexed it).
- ``"fail"``: the fault is raised to the caller and every later lifecycle call raises it too (a
  server then stops, ``kvplug serve --on-cache-failure fail``).

``hand_over`` computes the faulty cache's pages without asking it anything: all pages, minus the
free list (with pending lazy frees), minus every page in a live request's row. They go back to the
free list. A live request's pages past its locked prefix stay its own; its prefix pages cannot
simply become its own too, since requests that matched the same prefix share them and a page has
one owner: ``kvplug.prefix_cache.inherited.InheritedPrefixes``, in front of the new cache, holds
them locked once per request, and they return to the free list through eviction once the last
request using them is done. The allocator and the backend then point at the new cache.
``KVBackend.reset_prefix_cache`` uses the same hand-over with the current cache reset.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np
import torch

from kvplug.interface import AllCleared, BasePrefixCache, BaseTieredPrefixCache, InvalidArgumentError, PrefixCacheFault
from kvplug.prefix_cache import ownership
from kvplug.prefix_cache.inherited import InheritedPrefixes

if TYPE_CHECKING:
    from kvplug.backend import KVBackend

logger = logging.getLogger("kvplug.backend")

POLICIES = ("fallback", "fail")
LAST_RESORT = "naive"


def check_policy(on_cache_failure: Any) -> str:
    if on_cache_failure not in POLICIES:
        raise InvalidArgumentError(f"on_cache_failure must be one of {list(POLICIES)}, got {on_cache_failure!r}")
    return on_cache_failure


class CacheGuard:
    """The policy and the record of prefix-cache faults of one backend.

    Args:
        name: the cache's name now (its registered name, or its class).
        policy: ``"fallback"`` or ``"fail"``.
        build: ``build(name) -> (cache, name)``: a new, empty cache by registered name, checked
            when it is not trusted.
        fallback: the name of the first replacement.

    Attributes:
        failures: faults recovered from (or, with ``"fail"``, met).
        last_fault: the message of the latest fault, ``None`` before any.
        stopped: the fault that stopped the backend (policy ``"fail"``), else ``None``.
    """

    def __init__(self, name: str, policy: str = "fallback",
                 build: Callable[[str], tuple[BasePrefixCache, str]] | None = None, fallback: str = LAST_RESORT) -> None:
        self.name = name
        self.policy = check_policy(policy)
        self._build = build
        self.fallback = fallback
        self.failures = 0
        self.last_fault: str | None = None
        self.stopped: PrefixCacheFault | None = None

    def check_running(self) -> None:
        """Raise the fault that stopped the backend, if one did."""
        if self.stopped is not None:
            raise PrefixCacheFault(f"the backend stopped after its prefix cache failed (on_cache_failure='fail'): "
                                   f"{self.stopped}", plugin=self.stopped.plugin, method=self.stopped.method)

    def recover(self, backend: "KVBackend", fault: PrefixCacheFault, *, during: str = "") -> None:
        """Replace the faulty cache (policy ``"fallback"``), or record the fault and raise it."""
        self.failures += 1
        self.last_fault = str(fault)
        if self.policy == "fail" or self._build is None:
            self.stopped = fault
            logger.error("kvplug: prefix cache fault in %s, the backend stops (on_cache_failure='fail'): %s",
                         during, fault)
            raise fault
        replacement = self.fallback if self.failures == 1 else LAST_RESORT
        try:
            cache, name = self._build(replacement)
            done = hand_over(backend, cache)
        except PrefixCacheFault as again:  # the replacement faulted at once: the last resort cannot
            logger.warning("kvplug: the replacement prefix cache %r failed too (%s)", replacement, again)
            cache, name = self._build(LAST_RESORT)
            done = hand_over(backend, cache)
        logger.warning(
            "kvplug: prefix cache %r failed in %s (%s); %d of its pages went back to the free list, %d pages of "
            "running requests' locked prefixes are kept for them; prefix cache %r takes over",
            self.name, during, fault, done.freed_pages, done.inherited_pages, name,
        )
        self.name = name

    def as_dict(self) -> dict:
        """For ``/health`` and ``/kvplug/stats``."""
        return {"prefix_cache": self.name, "cache_failures": self.failures, "last_cache_fault": self.last_fault,
                "on_cache_failure": self.policy, "stopped": self.stopped is not None}


class HandOver(NamedTuple):
    """What ``hand_over`` did.

    Attributes:
        freed_pages: pages the old cache held that went back to the free list.
        inherited_pages: pages of running requests' locked prefixes, kept (``InheritedPrefixes``).
    """

    freed_pages: int
    inherited_pages: int


def hand_over(backend: "KVBackend", cache: BasePrefixCache, *, reset_old: bool = False) -> HandOver:
    """Give ``backend``'s pool to ``cache`` (empty; the current cache itself with ``reset_old``,
    which resets it here), asking the old cache nothing (see the module docstring)."""
    allocator, tables = backend.allocator, backend.tables
    old = allocator.prefix_cache
    if reset_old and isinstance(cache, BaseTieredPrefixCache):
        raise InvalidArgumentError("a prefix cache with a host tier cannot be reset through a hand-over")
    if allocator.has_pending_loads:  # the faulty cache's host memory goes with it: no copy may still read it
        allocator.wait_for_loads()  # the one wait of a hand-over, on the fault path only
    size, num_pages, width = allocator.page_size, allocator.num_pages, tables.row_width
    kept = np.zeros(num_pages, dtype=bool)
    kept[allocator.free_list.snapshot(include_pending=True).astype(np.int64) // size] = True
    live = allocator.live_requests
    for request in live:  # past its prefix: its own pages; its prefix: kept for it below
        end = min(request.allocated_len, width)
        if end:
            kept[tables.host_table[request.row, 0:end:size].astype(np.int64) // size] = True
    reclaimed = np.flatnonzero(~kept).astype(np.int32) * size
    listeners = tuple(getattr(old, "kv_event_listeners", ()))
    if reset_old:
        old.reset()
        cache = old.inner if isinstance(old, InheritedPrefixes) else old  # never a layer over a layer
    # the new cache's answers first: if it faults here, the backend is still unchanged
    holding = [request for request in live if request.prefix_len]
    if isinstance(cache, BaseTieredPrefixCache) and getattr(cache, "host_pool", None) is None:
        cache.attach_kv_pool(backend.pool)
    layer = InheritedPrefixes(cache, num_pages=num_pages, page_size=size) if holding else cache
    if holding and isinstance(cache, BaseTieredPrefixCache):  # NOTE: the layer is not tiered
        logger.warning("kvplug: running requests hold prefixes of the replaced cache; the replacement's host tier "
                       "stays unused until the backend is rebuilt")
    empty = torch.empty(0, dtype=torch.int32)  # prefix caches keep host data
    handles = []
    for request in live:
        if request.prefix_len:
            handle = layer.inherit(torch.from_numpy(tables.host_table[request.row, : request.prefix_len].copy()))
        else:
            handle = layer.match_prefix(empty).handle
            layer.lock_handle(handle)
        handles.append(handle)
    for owned in _chain(old):
        ownership.release(owned)
    allocator.free_list.release(reclaimed, immediately=True)
    for request, handle in zip(live, handles):
        allocator.states.rehandle(request, handle)
    allocator.replace_cache(layer)
    backend.prefix_cache = layer
    backend.take_cache_ownership(layer)
    if not reset_old:
        for listener in listeners:  # what subscribed to the old cache's events follows the new one
            listener(AllCleared())
            layer.add_kv_event_listener(listener)
    return HandOver(int(reclaimed.size), layer.inherited_pages if holding else 0)


def _chain(cache: Any) -> list:
    """``cache`` and the caches it wraps (``.inner``), outermost first."""
    chain = [cache]
    while getattr(chain[-1], "inner", None) is not None and len(chain) < 8:
        chain.append(chain[-1].inner)
    return chain


def checked(cache: BasePrefixCache, name: str, num_pages: int, page_size: int) -> BasePrefixCache:
    """``cache`` as the backend uses it: as it is when its class is ``trusted``, else in a
    ``CheckedPrefixCache`` (a ``CheckedTieredPrefixCache`` for a cache with a host tier)."""
    if getattr(type(cache), "trusted", False):
        return cache
    if isinstance(cache, BaseTieredPrefixCache):
        from kvplug.prefix_cache.checked_tiered import CheckedTieredPrefixCache

        return CheckedTieredPrefixCache(cache, num_pages=num_pages, page_size=page_size, name=name)
    from kvplug.prefix_cache.checked import CheckedPrefixCache

    return CheckedPrefixCache(cache, num_pages=num_pages, page_size=page_size, name=name)


def guarded_cache(
    cache: BasePrefixCache, spec: Any, manager: Any, device: torch.device, page_size: int, num_pages: int,
    options: Any, on_cache_failure: str, fallback: str,
) -> tuple[BasePrefixCache, CacheGuard]:
    """The cache a backend uses (``checked``) and its guard, which builds replacements by name."""
    check_policy(on_cache_failure)
    if not isinstance(fallback, str):
        raise InvalidArgumentError(f"fallback_prefix_cache must be a registered prefix cache name, got {fallback!r}")
    name = spec if isinstance(spec, str) else type(cache).__name__

    def build(replacement: str) -> tuple[BasePrefixCache, str]:
        replacement_options = dict(options) if replacement == name else {}
        try:
            fresh = manager.create_prefix_cache(replacement, device=device, page_size=page_size, **replacement_options)
        except Exception as error:  # e.g. the faulty plugin's factory fails too
            raise PrefixCacheFault(f"building the replacement prefix cache {replacement!r} failed: "
                                   f"{type(error).__name__}: {error}", plugin=replacement, method="factory") from error
        return checked(fresh, replacement, num_pages, page_size), replacement

    return checked(cache, name, num_pages, page_size), CacheGuard(name, on_cache_failure, build, fallback)
