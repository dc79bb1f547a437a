"""``naive``: the prefix cache that never matches and keeps nothing.

With it every request recomputes its whole prompt and the allocator frees all of a finished
request's pages. It is the baseline the ``radix`` cache is measured against.
"""

from __future__ import annotations

import torch

from kvplug.interface import (
    AllCleared,
    BaseCacheHandle,
    BasePrefixCache,
    InsertResult,
    InvalidArgumentError,
    MatchResult,
    PrefixCacheConfig,
    SizeInfo,
)
from kvplug.prefix_cache.validation import (
    check_insert_arguments,
    check_token_ids,
    checked_evict_size,
    reject_foreign_handle,
    reject_unlock_flag,
)


class NaiveCacheHandle(BaseCacheHandle):
    """A handle that covers nothing."""

    def __init__(self, cache: NaivePrefixCache, empty: torch.Tensor) -> None:
        self.cached_len = 0
        self.cache = cache
        self._empty = empty

    def get_matched_indices(self) -> torch.Tensor:
        return self._empty


class NaivePrefixCache(BasePrefixCache):
    """Keeps nothing: ``match_prefix`` always returns length 0, ``insert_prefix`` reports 0 cached.

    Its KV events are honest about that: no page is ever stored or removed; ``reset`` reports
    ``AllCleared``."""

    publishes_kv_events = True
    trusted = True  # built in: a KVBackend uses its answers unchecked

    def __init__(self, config: PrefixCacheConfig) -> None:
        if config.options:
            raise InvalidArgumentError(f"the naive prefix cache takes no options, got {sorted(config.options)}")
        self.device = config.device
        self.page_size = config.page_size
        self._empty = torch.empty(0, dtype=torch.int32, device=self.device)
        self._handle = NaiveCacheHandle(self, self._empty)

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        check_token_ids(input_ids, self.device)
        return MatchResult(self._handle)

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        if unlock.__class__ is not bool:
            reject_unlock_flag(unlock)
        if not isinstance(handle, NaiveCacheHandle) or handle.cache is not self:
            reject_foreign_handle("naive", handle)

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        check_insert_arguments(input_ids, indices, self.device, self.page_size)
        return InsertResult(0, self._handle)

    def evict(self, size: int) -> torch.Tensor:
        checked_evict_size(size, evictable=0, protected=0)
        return self._empty

    def reset(self) -> None:
        if self.has_kv_event_listeners:
            self.emit_kv_event(AllCleared())

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(evictable_size=0, protected_size=0)

    def check_integrity(self) -> None:
        pass
