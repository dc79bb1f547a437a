"""The prefix-cache contract (SPEC §3): ``BasePrefixCache``, its handle and result types.

Method names match mini-sglang's ``BasePrefixCache`` so that code written against one runs against
the other. A prefix cache maps page-aligned token-id sequences to the KV-pool token locations that
hold their K/V. It never allocates or frees pool memory itself: ``evict`` hands locations back to
the caller (the allocator), and ``insert_prefix`` tells the caller how much of its copy is a
duplicate it must free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

import torch

from kvplug.interface.errors import InvalidArgumentError


class BaseCacheHandle(ABC):
    """A matched (or inserted) prefix.

    Attributes:
        cached_len: number of leading tokens of the queried sequence that are cached; always a
            multiple of the cache's page size.

    A handle from ``match_prefix`` may be evicted at any time until the caller passes it to
    ``lock_handle``; it stays valid until the matching ``lock_handle(handle, unlock=True)``.
    """

    cached_len: int

    @abstractmethod
    def get_matched_indices(self) -> torch.Tensor:
        """Token locations of the cached prefix.

        Returns:
            shape ``[cached_len]``, int32, on the cache's device.
        """


class MatchResult(NamedTuple):
    """Result of ``match_prefix``."""

    handle: BaseCacheHandle

    @property
    def cuda_handle(self) -> BaseCacheHandle:
        """mini-sglang's name for ``handle``."""
        return self.handle


class InsertResult(NamedTuple):
    """Result of ``insert_prefix``.

    ``cached_len`` leading tokens were already in the cache before this insert: the caller owns
    duplicate locations for them (``indices[:cached_len]``) and must free those it does not use.
    ``handle`` covers the whole inserted (page-aligned) prefix.
    """

    cached_len: int
    handle: BaseCacheHandle


class SizeInfo(NamedTuple):
    """Token counts held by a cache. ``protected`` tokens are locked by at least one handle."""

    evictable_size: int
    protected_size: int

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


def _frozen_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


@dataclass(frozen=True)
class PrefixCacheConfig:
    """What a prefix-cache factory receives. Later interface versions only add defaulted fields.

    Attributes:
        device: device of the tensors the cache takes and returns (token ids, locations).
        page_size: tokens per KV page; every cached length is a multiple of it.
        options: plugin-specific keyword options from ``create_prefix_cache(..., **options)``.
    """

    device: torch.device = torch.device("cpu")
    page_size: int = 1
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1:
            raise InvalidArgumentError(f"page_size must be a positive int, got {self.page_size!r}")
        from kvplug.devices import resolve_device  # kvplug.devices imports the interface's errors

        object.__setattr__(self, "device", resolve_device(self.device))
        object.__setattr__(self, "options", _frozen_mapping(self.options))


class BasePrefixCache(ABC):
    """Abstract prefix cache; the seven abstract members below are the whole v1 surface.

    All tensors are 1-D int32 on the cache's device: ``input_ids`` are token ids, ``indices`` and
    returned locations are KV-pool token locations.
    """

    @abstractmethod
    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        """Find the longest cached page-aligned prefix of ``input_ids``.

        Args:
            input_ids: shape ``[n]``, int32, cache device.

        Returns the handle (``cached_len`` may be 0). It is safe to use only after ``lock_handle``.
        Matching refreshes the matched entries' recency for LRU eviction.
        """

    @abstractmethod
    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Protect (or, with ``unlock=True``, release) the entries of ``handle`` from eviction.

        Locks nest: an entry is evictable again once every lock on it is released. Only counts
        change, never the cached content.
        """

    @abstractmethod
    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        """Cache ``input_ids`` with their locations.

        Args:
            input_ids: shape ``[n]``, int32, cache device; ``n`` a multiple of the page size.
            indices: shape ``[n]``, int32, cache device; the locations holding their K/V.

        Returns how many leading tokens were already cached (their ``indices`` are duplicates the
        caller must free) and a handle covering all ``n`` tokens (not locked).
        """

    @abstractmethod
    def evict(self, size: int) -> torch.Tensor:
        """Evict at least ``size`` tokens from unlocked entries, least recently used first.

        Returns the freed locations: shape ``[m]`` with ``m >= size``, int32, cache device.
        ``evict(0)`` is a no-op returning an empty tensor; asking for more than the evictable size
        raises and evicts nothing.
        """

    @abstractmethod
    def reset(self) -> None:
        """Forget every entry (the caller reclaims the pool memory wholesale)."""

    @property
    @abstractmethod
    def size_info(self) -> SizeInfo:
        """Evictable and protected token counts."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` (or a subclass) if an internal invariant is broken."""
