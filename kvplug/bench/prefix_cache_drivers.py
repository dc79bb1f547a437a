"""One driver per prefix-cache implementation benchmarked by ``kvplug bench prefix-cache``.

A driver turns workload data into the implementation's native inputs ahead of time (``prepare``,
never timed) and exposes the calls a scheduler makes, each timed on its own by the workloads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

import kvplug


class CacheDriver(ABC):
    """The scheduler-side calls of one prefix cache, over inputs prepared in its native form."""

    name: str

    @abstractmethod
    def prepare(self, token_ids: np.ndarray, locations: np.ndarray) -> Any:
        """Native inputs for one sequence. ``token_ids``, ``locations``: shape ``[n]``, int32, cpu."""

    @abstractmethod
    def match_lock(self, item: Any) -> Any:
        """Match the sequence and lock the result; returns what ``unlock`` needs."""

    @abstractmethod
    def matched_indices(self, matched: Any) -> Any:
        """The matched prefix's locations as one tensor (what the scheduler copies to its table row)."""

    @abstractmethod
    def cached_len(self, matched: Any) -> int:
        """Tokens matched (for checking both sides did the same work; not timed)."""

    @abstractmethod
    def insert(self, item: Any) -> Any:
        """Insert the whole sequence with its locations."""

    @abstractmethod
    def unlock(self, matched: Any) -> None:
        """Release the lock taken by ``match_lock``."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens``; returns how many were freed."""

    @abstractmethod
    def total_tokens(self) -> int:
        """Tokens held (evictable + protected)."""


class KvplugDriver(CacheDriver):
    """A prefix cache built by name through ``kvplug.create_prefix_cache`` (built-in or plugin).

    A cache with the ``HostArrayCalls`` capability is driven as kvplug's allocator drives it: with
    host int32 arrays (``match_host`` / ``insert_host`` / ``evict_host``); ``tensor_inputs=True``
    (``--tensor-inputs``) drives it through the public tensor methods instead, as a third party would.
    """

    def __init__(self, name: str, page_size: int, device: str = "cpu", *, tensor_inputs: bool = False) -> None:
        self.name = f"kvplug-{name}"
        self.device = torch.device(device)
        self.cache = kvplug.create_prefix_cache(name, page_size=page_size, device=device)
        self._use_host_arrays(tensor_inputs)

    def _use_host_arrays(self, tensor_inputs: bool) -> None:
        from kvplug.prefix_cache.host_arrays import HostArrayCalls

        # by name too: a --baseline copy of this version has its own HostArrayCalls class
        capable = any(base is HostArrayCalls or base.__name__ == "HostArrayCalls" for base in type(self.cache).__mro__)
        self.host_arrays = not tensor_inputs and self.device.type == "cpu" and capable
        if self.host_arrays:  # bound methods: what the allocator's calls cost, no adapter in between
            self.match_lock = self._match_lock_host
            self.insert = self._insert_host
            self.evict = self._evict_host

    def prepare(self, token_ids: np.ndarray, locations: np.ndarray) -> Any:
        ids = np.ascontiguousarray(token_ids, dtype=np.int32)
        locations = np.ascontiguousarray(locations, dtype=np.int32)
        if self.host_arrays:
            return ids, locations
        return torch.from_numpy(ids).to(self.device), torch.from_numpy(locations).to(self.device)

    def match_lock(self, item: tuple[torch.Tensor, torch.Tensor]) -> Any:
        handle = self.cache.match_prefix(item[0]).handle
        self.cache.lock_handle(handle)
        return handle

    def _match_lock_host(self, item: tuple[np.ndarray, np.ndarray]) -> Any:
        handle = self.cache.match_host(item[0])
        self.cache.lock_handle(handle)
        return handle

    def matched_indices(self, matched: Any) -> torch.Tensor:
        return matched.get_matched_indices()

    def cached_len(self, matched: Any) -> int:
        return matched.cached_len

    def insert(self, item: tuple[torch.Tensor, torch.Tensor]) -> Any:
        return self.cache.insert_prefix(item[0], item[1])

    def _insert_host(self, item: tuple[np.ndarray, np.ndarray]) -> Any:
        return self.cache.insert_host(item[0], item[1])

    def unlock(self, matched: Any) -> None:
        self.cache.lock_handle(matched, unlock=True)

    def evict(self, num_tokens: int) -> int:
        return int(self.cache.evict(num_tokens).shape[0])

    def _evict_host(self, num_tokens: int) -> int:
        return self.cache.evict_host(num_tokens).shape[0]

    def total_tokens(self) -> int:
        return self.cache.size_info.total_size


class CheckedKvplugDriver(KvplugDriver):
    """``KvplugDriver`` behind ``CheckedPrefixCache``, as a ``KVBackend`` runs an untrusted plugin:
    measures what checking every answer costs (``--checked``)."""

    #: pool size the checks assume: every location the workloads use lies below it
    POOL_TOKENS = 3 << 20

    def __init__(self, name: str, page_size: int, device: str = "cpu") -> None:
        super().__init__(name, page_size, device, tensor_inputs=True)
        from kvplug.prefix_cache.checked import CheckedPrefixCache

        self.name = f"kvplug-{name}+checked"
        self.cache = CheckedPrefixCache(self.cache, num_pages=self.POOL_TOKENS // page_size, page_size=page_size,
                                        name=name)
