"""``CheckedTieredPrefixCache``: a third-party prefix cache with a host tier, every answer checked.

``CheckedPrefixCache`` checks the version-1 face (match, lock, insert, evict, sizes); a tiered cache
answers four more questions whose answers the allocator acts on, and a wrong one corrupts the pool
as surely: a host match longer than the query or off the page grid points a row at pages nobody
wrote, a load whose handle does not keep the given locations leaves a request reading someone
else's K/V. So, again at a cost proportional to the answer:

- ``match_tiered``: its device part is checked as a match is; ``host_len`` is page-aligned and fits
  the query after the device part; the host handle covers both (``cached_len + host_len`` tokens).
  A host handle's locations do not exist before its load, so the wrapper's handle refuses to give
  them until then.
- ``load_host_prefix`` / ``start_host_load``: kvplug's locations (whole, free pages the cache does
  not hold) are checked before the plugin sees them; the returned handle must keep the device part
  and then exactly those locations. The loaded pages become the cache's, locked as often as the
  host handle is. ``TierCopyError`` passes through unchanged: the contract lets a load fail with
  nothing changed, and the allocator then computes those tokens.
- ``loads_in_flight``: a tuple of ``HostLoad``; a load's ``done`` is ``None`` or has ``query``,
  ``wait`` and ``synchronize`` (it is then called as a CUDA event would be: trusted like one).
- ``host_size_info`` / ``tier_stats``: non-negative sizes, a ``TierStats``.

``KVBackend.stats`` runs on any thread and never calls an untrusted plugin, so the wrapper keeps the
plugin's latest ``tier_stats`` (``tracked_tier_stats``), asked on the serving thread after each
attach, load and eviction (what changes the tier).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

from kvplug.interface import (
    BaseCacheHandle,
    BaseTieredPrefixCache,
    HostLoad,
    InvalidArgumentError,
    KVPlugError,
    PrefixCacheFault,
    SizeInfo,
    TieredMatchResult,
    TierStats,
)
from kvplug.prefix_cache.checked import CheckedHandle, CheckedPrefixCache
from kvplug.prefix_cache.validation import check_token_ids


class HostHandle(CheckedHandle):
    """The checked handle of a whole tiered match: ``cached_len`` tokens, of which the first
    ``device_len`` are on the device (``pages`` lists theirs) until the load makes all of them so.

    Attributes:
        device_len: tokens on the device now (``cached_len`` once loaded).
    """

    def __init__(self, owner: "CheckedTieredPrefixCache", inner: Any, cached_len: int, device: CheckedHandle) -> None:
        super().__init__(owner, inner, cached_len, device.get_matched_indices(), device.pages)
        self.device_len = device.cached_len

    @property
    def loaded(self) -> bool:
        return self.device_len == self.cached_len

    def get_matched_indices(self) -> torch.Tensor:
        if not self.loaded:
            raise InvalidArgumentError(f"the last {self.cached_len - self.device_len} of this handle's {self.cached_len} "
                                       "tokens are in host memory: load them (load_host_prefix) before reading them")
        return self._indices


class CheckedTieredPrefixCache(CheckedPrefixCache, BaseTieredPrefixCache):
    """``inner`` (an untrusted ``BaseTieredPrefixCache``, empty) with every answer checked; see the
    module docstring and ``CheckedPrefixCache`` for the arguments."""

    def __init__(self, inner: BaseTieredPrefixCache, *, num_pages: int, page_size: int, name: str | None = None) -> None:
        if not isinstance(inner, BaseTieredPrefixCache):
            raise InvalidArgumentError(f"expected a BaseTieredPrefixCache, got {type(inner).__name__}")
        super().__init__(inner, num_pages=num_pages, page_size=page_size, name=name)
        self.tracked_tier_stats: TierStats = TierStats(page_size=page_size)

    def _tier_call(self, method: str, call):
        """``call()``; kvplug's own errors (a start-up size check, ``TierCopyError``) pass through."""
        try:
            return call()
        except KVPlugError:
            raise
        except (Exception, SystemExit) as error:
            raise self._fault(method, f"raised {type(error).__name__}: {error}") from error

    @property
    def host_pool(self) -> Any:
        return getattr(self.inner, "host_pool", None)

    def attach_kv_pool(self, pool: Any) -> None:
        self._tier_call("attach_kv_pool", lambda: self.inner.attach_kv_pool(pool))
        self.tier_stats()

    def evict(self, size: int) -> torch.Tensor:
        evicted = super().evict(size)
        try:
            self.tier_stats()  # an eviction writes back to host memory
        except PrefixCacheFault:  # nothing was handed back: the pages stay the cache's, as CheckedPrefixCache.evict does
            pages = self._pages("evict", evicted.numpy(), "the evicted locations")
            self._held[pages] = True
            self._held_pages += int(pages.size)
            raise
        return evicted

    # ------------------------------------------------------------------ matches
    def match_tiered(self, input_ids: torch.Tensor) -> TieredMatchResult:
        check_token_ids(input_ids, self.device)
        result = self._call("match_tiered", lambda: self.inner.match_tiered(input_ids))
        if not isinstance(result, TieredMatchResult):
            raise self._fault("match_tiered", f"returned {type(result).__name__}, expected TieredMatchResult")
        n = int(input_ids.shape[0])
        cached_len = self._length("match_tiered", getattr(result.handle, "cached_len", None), n, "cached_len")
        device = self._checked_handle("match_tiered", result.handle, cached_len, "the match")
        host_len = self._length("match_tiered", result.host_len, n - cached_len, "host_len")
        if not host_len:
            return TieredMatchResult(device, device, 0)
        total = self._length("match_tiered", getattr(result.host_handle, "cached_len", None), n,
                             "a host handle with cached_len")
        if total != cached_len + host_len:
            raise self._fault("match_tiered", f"returned a host handle of {total} tokens for {cached_len} on the device "
                                              f"and host_len {host_len}")
        return TieredMatchResult(device, HostHandle(self, result.host_handle, total, device), host_len)

    # ------------------------------------------------------------------ loads
    def load_host_prefix(self, host_handle: BaseCacheHandle, device_indices: torch.Tensor) -> BaseCacheHandle:
        handle, given = self._load_arguments(host_handle, device_indices)
        loaded = self._tier_call("load_host_prefix", lambda: self.inner.load_host_prefix(handle.inner, device_indices))
        return self._loaded("load_host_prefix", handle, loaded, given)

    def start_host_load(self, host_handle: BaseCacheHandle, device_indices: torch.Tensor) -> HostLoad:
        handle, given = self._load_arguments(host_handle, device_indices)
        load = self._tier_call("start_host_load", lambda: self.inner.start_host_load(handle.inner, device_indices))
        if not isinstance(load, HostLoad):
            raise self._fault("start_host_load", f"returned {type(load).__name__}, expected a HostLoad")
        self._check_done("start_host_load", load.done)
        return HostLoad(self._loaded("start_host_load", handle, load.handle, given), load.done)

    def _load_arguments(self, host_handle: Any, device_indices: Any) -> tuple[HostHandle, np.ndarray]:
        """kvplug's side of a load, checked before the plugin sees it (an ``InvalidArgumentError``)."""
        if not isinstance(host_handle, HostHandle) or host_handle.owner is not self or host_handle.loaded:
            raise InvalidArgumentError(f"expected a host handle of this checked {self.name!r} cache whose host part is "
                                       f"not loaded yet, got {host_handle!r}")
        if not host_handle.locks:
            raise InvalidArgumentError("lock the host handle (lock_handle) before loading it")
        want = host_handle.cached_len - host_handle.device_len
        if not isinstance(device_indices, torch.Tensor) or device_indices.dtype is not torch.int32 \
                or device_indices.dim() != 1 or device_indices.device.type != "cpu" or device_indices.numel() != want:
            raise InvalidArgumentError(f"device_indices must be a 1-D int32 CPU tensor of the host part's {want} "
                                       f"locations, got {device_indices!r:.80}")
        given = device_indices.numpy()
        try:
            pages = self._pages("load_host_prefix", given, "device_indices", whole=False)
        except PrefixCacheFault as error:  # the caller's locations, not the plugin's answer
            raise InvalidArgumentError(f"device_indices: {error}") from None
        if pages.size and self._held[pages].any():
            page = int(pages[np.flatnonzero(self._held[pages])[0]])
            raise InvalidArgumentError(f"device_indices: location {page * self.page_size} is cached already, not free")
        return host_handle, given

    def _loaded(self, method: str, handle: HostHandle, answer: Any, given: np.ndarray) -> HostHandle:
        """Check the handle a load returned (the device part, then exactly ``given``); the loaded
        pages become the cache's, locked as often as ``handle``."""
        if getattr(answer, "cached_len", None) != handle.cached_len:
            raise self._fault(method, f"returned a handle of {getattr(answer, 'cached_len', None)!r} tokens for a "
                                      f"load completing {handle.cached_len}")
        located = self._locations(method, self._call(method, answer.get_matched_indices), "the loaded handle's indices")
        device = handle.device_len
        if located.size != handle.cached_len or not np.array_equal(located[device:], given) \
                or not np.array_equal(located[:device], handle._indices.numpy()):
            raise self._fault(method, "returned a handle that does not keep the matched device part followed by the "
                                      "given device_indices")
        new_pages = self._pages(method, given, "device_indices")
        self._held[new_pages] = True
        self._held_pages += int(new_pages.size)
        if handle.locks:
            self._locks[new_pages] += handle.locks
            self._locked_pages += int(new_pages.size)
        handle.pages = np.concatenate([handle.pages, new_pages])
        handle._indices = self._as_tensor(located)
        handle.device_len = handle.cached_len
        self._check_size(method)
        self.tier_stats()
        return handle

    def _check_done(self, method: str, done: Any) -> None:
        if done is not None and not all(callable(getattr(done, name, None)) for name in ("query", "wait", "synchronize")):
            raise self._fault(method, f"returned a HostLoad whose done ({type(done).__name__}) lacks query / wait / "
                                      "synchronize")

    def loads_in_flight(self, handle: BaseCacheHandle) -> tuple[HostLoad, ...]:
        if not isinstance(handle, CheckedHandle) or handle.owner is not self:
            raise InvalidArgumentError(f"expected a handle from this checked {self.name!r} cache, got {handle!r}")
        loads = self._call("loads_in_flight", lambda: self.inner.loads_in_flight(handle.inner))
        if not isinstance(loads, tuple) or not all(isinstance(load, HostLoad) for load in loads):
            raise self._fault("loads_in_flight", f"returned {loads!r:.80}, expected a tuple of HostLoad")
        for load in loads:
            self._check_done("loads_in_flight", load.done)
        return loads

    # ------------------------------------------------------------------ sizes
    @property
    def host_size_info(self) -> SizeInfo:
        size = self._call("host_size_info", lambda: self.inner.host_size_info)
        try:
            evictable, protected = operator.index(size.evictable_size), operator.index(size.protected_size)
        except (AttributeError, TypeError):
            raise self._fault("host_size_info", f"returned {size!r:.80}, expected a SizeInfo of two ints") from None
        if evictable < 0 or protected < 0:
            raise self._fault("host_size_info", f"returned negative sizes {evictable}, {protected}")
        return SizeInfo(evictable, protected)

    def tier_stats(self) -> TierStats:
        stats = self._call("tier_stats", self.inner.tier_stats)
        if not isinstance(stats, TierStats):
            raise self._fault("tier_stats", f"returned {type(stats).__name__}, expected TierStats")
        self.tracked_tier_stats = stats
        return stats

