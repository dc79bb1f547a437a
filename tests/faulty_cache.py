"""A third-party prefix cache that misbehaves on purpose (issue 32): the built-in radix cache behind
a plugin class that is not ``trusted``, which, from its ``after``-th call of one method on, raises
or gives a contract-breaking answer.

Registered as ``faulty`` by ``FaultyCachePlugin`` (``manager.register(FaultyCachePlugin())``);
options: ``fault`` (a name of ``FAULTS``), ``after`` (calls of that method that behave first,
default 0), ``times`` (how many calls misbehave, default: all from then on).
"""

from __future__ import annotations

import dataclasses

import torch

import kvplug
from kvplug.interface import BaseCacheHandle, BasePrefixCache, InsertResult, MatchResult, SizeInfo
from kvplug.prefix_cache.radix import RadixPrefixCache


class _LyingHandle(BaseCacheHandle):
    """A handle whose ``cached_len`` / indices are what the fault says, not the truth."""

    def __init__(self, cached_len, indices: torch.Tensor) -> None:
        self.cached_len = cached_len
        self._indices = indices

    def get_matched_indices(self) -> torch.Tensor:
        return self._indices


def _far(tensor: torch.Tensor) -> torch.Tensor:
    bad = tensor.clone()
    bad[0] = 10**7  # outside any test pool
    return bad


def _twice(tensor: torch.Tensor, page_size: int) -> torch.Tensor:
    """The first page listed twice (the tensor keeps its length when it has two pages)."""
    first = tensor[:page_size]
    return torch.cat([first, first, tensor[2 * page_size:]])


#: method -> fault names (what the method does once faulting)
FAULTS = {
    "match_prefix": ("raise", "outside_pool", "twice", "long_cached_len", "unaligned", "exit"),
    "lock_handle": ("raise",),
    "unlock": ("raise",),
    "insert_prefix": ("raise", "huge_cached_len", "unaligned_cached_len", "lost_locations"),
    "evict": ("raise", "short", "twice", "float", "outside_pool"),
    "size_info": ("raise", "overstates_evictable", "wrong_total"),
}


class FaultyCache(BasePrefixCache):
    """``radix`` with a fault (see the module docstring). ``calls`` counts calls per method."""

    known_faults = FAULTS

    def __init__(self, config: kvplug.PrefixCacheConfig) -> None:
        options = dict(config.options)
        fault = options.pop("fault", "none")
        self.method, _, self.fault = fault.partition(":")
        self.after = int(options.pop("after", 0))
        self.times = options.pop("times", None)
        if fault != "none" and self.fault not in self.known_faults.get(self.method, ()):
            raise ValueError(f"unknown fault {fault!r}; known: {self.known_faults}")
        self.inner = self._inner_cache(config, options)
        self.page_size = config.page_size
        self.device = config.device
        self.calls: dict[str, int] = {}
        self.faults = 0

    def _inner_cache(self, config: kvplug.PrefixCacheConfig, options: dict) -> BasePrefixCache:
        return RadixPrefixCache(dataclasses.replace(config, options=options))

    def _faulting(self, method: str) -> str | None:
        count = self.calls.get(method, 0)
        self.calls[method] = count + 1
        if method != self.method or count < self.after:
            return None
        if self.times is not None and self.faults >= int(self.times):
            return None
        self.faults += 1
        if self.fault == "raise":
            raise RuntimeError(f"{method} fails on purpose")
        if self.fault == "exit":
            raise SystemExit(f"{method} exits on purpose")
        return self.fault

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        fault = self._faulting("match_prefix")
        result = self.inner.match_prefix(input_ids)
        handle, size = result.handle, self.page_size
        indices = handle.get_matched_indices()
        if fault is None or (handle.cached_len == 0 and fault != "long_cached_len"):
            if fault is not None:
                self.faults -= 1
                self.calls["match_prefix"] -= 1  # nothing to lie about: fault on the next call
            return result
        if fault == "outside_pool":
            return MatchResult(_LyingHandle(handle.cached_len, _far(indices)))
        if fault == "twice":
            if handle.cached_len < 2 * size:
                return MatchResult(_LyingHandle(2 * size, torch.cat([indices[:size], indices[:size]])))
            return MatchResult(_LyingHandle(handle.cached_len, _twice(indices, size)))
        if fault == "long_cached_len":
            return MatchResult(_LyingHandle(handle.cached_len + size, indices))
        return MatchResult(_LyingHandle(handle.cached_len, indices + 1))  # "unaligned"

    def lock_handle(self, handle, unlock: bool = False) -> None:
        self._faulting("unlock" if unlock else "lock_handle")
        self.inner.lock_handle(handle, unlock)

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        fault = self._faulting("insert_prefix")
        result = self.inner.insert_prefix(input_ids, indices)
        if fault == "huge_cached_len":
            return InsertResult(10**6, result.handle)
        if fault == "unaligned_cached_len" and self.page_size > 1:
            return InsertResult(result.cached_len + 1, result.handle)
        if fault == "lost_locations" and input_ids.shape[0]:
            return InsertResult(0, result.handle)  # claims none was cached: its handle disagrees
        return result

    def evict(self, size: int) -> torch.Tensor:
        fault = self._faulting("evict")
        evicted = self.inner.evict(size)
        if fault == "short":
            return evicted[: max(0, size - 1) // self.page_size * self.page_size]
        if fault == "twice" and evicted.numel():
            return torch.cat([evicted[: self.page_size], evicted])
        if fault == "float":
            return evicted.float()
        if fault == "outside_pool" and evicted.numel():
            return _far(evicted)
        return evicted

    def reset(self) -> None:
        self.inner.reset()

    @property
    def size_info(self) -> SizeInfo:
        fault = self._faulting("size_info")
        size = self.inner.size_info
        if fault == "overstates_evictable":
            return SizeInfo(size.evictable_size + size.protected_size + self.page_size, 0)
        if fault == "wrong_total":
            return SizeInfo(size.evictable_size + self.page_size, size.protected_size)
        return size

    def check_integrity(self) -> None:
        self.inner.check_integrity()


class FaultyCachePlugin:
    """Registers ``faulty`` (``FaultyCache``)."""

    @kvplug.hookimpl
    def kvplug_register_prefix_caches(self, register):
        register("faulty", FaultyCache)


def all_faults() -> list[str]:
    return [f"{method}:{fault}" for method, faults in FAULTS.items() for fault in faults]
