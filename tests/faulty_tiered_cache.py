"""A third-party prefix cache with a host tier that misbehaves on purpose (issue 32): the built-in
tiered radix cache behind an untrusted plugin class. The version-1 faults are ``tests.faulty_cache``'s;
the tier's own methods gain theirs (``TIERED_FAULTS``). Registered as ``faulty-tiered`` by
``FaultyTieredCachePlugin``; options as ``faulty``'s, plus the tier's ``host_memory``.
"""

from __future__ import annotations

import dataclasses

import torch

import kvplug
from kvplug.interface import (
    BaseCacheHandle,
    BaseTieredPrefixCache,
    HostLoad,
    SizeInfo,
    TieredMatchResult,
    TierStats,
)
from kvplug.prefix_cache.tiered_radix import TieredRadixPrefixCache
from tests.faulty_cache import FAULTS, FaultyCache, _LyingHandle

#: the tier's methods -> fault names
TIERED_FAULTS = {
    "match_tiered": ("raise", "long_host_len", "unaligned_host_len", "short_host_handle"),
    "start_host_load": ("raise", "lost_locations", "bad_done", "not_a_load"),
    "loads_in_flight": ("raise", "not_a_tuple"),
    "host_size_info": ("negative",),
    "tier_stats": ("raise",),
}


class FaultyTieredCache(FaultyCache, BaseTieredPrefixCache):
    """``radix`` with ``host_memory`` and a fault (see the module docstring)."""

    known_faults = {**FAULTS, **TIERED_FAULTS}

    def _inner_cache(self, config: kvplug.PrefixCacheConfig, options: dict):
        return TieredRadixPrefixCache(dataclasses.replace(config, options=options))

    @property
    def host_pool(self):
        return self.inner.host_pool

    def attach_kv_pool(self, pool) -> None:
        self.inner.attach_kv_pool(pool)

    def match_tiered(self, input_ids: torch.Tensor) -> TieredMatchResult:
        fault = self._faulting("match_tiered")
        match = self.inner.match_tiered(input_ids)
        if fault is None:
            return match
        if not match.host_len:  # nothing to lie about: fault on a later call
            self._defer("match_tiered")
            return match
        size = self.page_size
        if fault == "long_host_len":
            return match._replace(host_len=int(input_ids.shape[0]) - match.handle.cached_len + size)
        if fault == "unaligned_host_len" and size > 1:
            return match._replace(host_len=match.host_len - 1)
        if fault == "short_host_handle":
            return match._replace(host_handle=_LyingHandle(match.host_handle.cached_len - size, torch.empty(0)))
        self._defer("match_tiered")
        return match

    def _defer(self, method: str) -> None:
        self.faults -= 1
        self.calls[method] -= 1

    def load_host_prefix(self, host_handle: BaseCacheHandle, device_indices: torch.Tensor) -> BaseCacheHandle:
        return self.start_host_load(host_handle, device_indices).handle

    def start_host_load(self, host_handle: BaseCacheHandle, device_indices: torch.Tensor) -> HostLoad:
        fault = self._faulting("start_host_load")
        load = self.inner.start_host_load(host_handle, device_indices)
        if fault == "lost_locations":
            indices = load.handle.get_matched_indices().clone()
            indices[-device_indices.shape[0]:] = device_indices.flip(0)  # the given pages, in the wrong order
            if device_indices.shape[0] == 1:
                indices[-1] = 10**7
            return HostLoad(_LyingHandle(load.handle.cached_len, indices), load.done)
        if fault == "bad_done":
            return HostLoad(load.handle, object())
        if fault == "not_a_load":
            return load.handle
        return load

    def loads_in_flight(self, handle: BaseCacheHandle) -> tuple[HostLoad, ...]:
        fault = self._faulting("loads_in_flight")
        loads = self.inner.loads_in_flight(handle)
        return list(loads) if fault == "not_a_tuple" else loads

    @property
    def host_size_info(self) -> SizeInfo:
        fault = self._faulting("host_size_info")
        size = self.inner.host_size_info
        return SizeInfo(-1, size.protected_size) if fault == "negative" else size

    def tier_stats(self) -> TierStats:
        self._faulting("tier_stats")
        return self.inner.tier_stats()


class FaultyTieredCachePlugin:
    """Registers ``faulty-tiered`` (``FaultyTieredCache``)."""

    @kvplug.hookimpl
    def kvplug_register_prefix_caches(self, register):
        register("faulty-tiered", FaultyTieredCache)


def all_tiered_faults() -> list[str]:
    return [f"{method}:{fault}" for method, faults in TIERED_FAULTS.items() for fault in faults]
