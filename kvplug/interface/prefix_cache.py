"""The prefix-cache contract (docs/design.md, section 3): ``BasePrefixCache``, its handle and result
types.

Method names match mini-sglang's ``BasePrefixCache`` so that code written against one runs against
the other. A prefix cache maps page-aligned token-id sequences to the KV-pool token locations that
hold their K/V. It never allocates or frees pool memory itself: ``evict`` hands locations back to
the caller (the allocator), and ``insert_prefix`` tells the caller how much of its copy is a
duplicate it must free.

KV cache events (additive to version 1): a cache may report the pages it stores and removes, and
its resets, to listeners (``add_kv_event_listener``) as ``BlockStored`` / ``BlockRemoved`` /
``AllCleared``, the events cache-aware routers (SGLang's router, NVIDIA Dynamo, llm-d) consume
from SGLang and vLLM. Plugins written before the events keep working unchanged: the base class
answers ``add_kv_event_listener`` with ``False`` (this cache reports nothing) unless the cache sets
``publishes_kv_events = True`` and calls ``emit_kv_event``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, NamedTuple, Optional, Union

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


#: ``medium`` of events about KV held in the accelerator's KV pool (SGLang's and vLLM's name for
#: the device tier); the only tier kvplug's caches index.
KV_MEDIUM_DEVICE = "GPU"


class BlockStored(NamedTuple):
    """Pages newly cached, in order along one path of the cache (each page follows the previous).

    Attributes:
        block_hashes: one hash per page. A page's hash is determined by its token ids and the hash
            of the page before it (``kvplug.prefix_cache.block_hashes``), so equal prefixes get equal
            hashes and a hash names a whole prefix, as in SGLang's and vLLM's events.
        parent_block_hash: hash of the cached page just before the first one, ``None`` when the
            first page starts a sequence.
        token_ids: the pages' token ids, ``len(block_hashes) * block_size`` of them.
        block_size: tokens per page (the cache's page size).
        medium: where the pages' KV lives (``KV_MEDIUM_DEVICE``).
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: Optional[int]
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = KV_MEDIUM_DEVICE


class BlockRemoved(NamedTuple):
    """Pages no longer cached (evicted), by the hashes ``BlockStored`` reported for them."""

    block_hashes: tuple[int, ...]
    medium: str = KV_MEDIUM_DEVICE


class AllCleared(NamedTuple):
    """Every page of the cache was dropped (``reset``)."""

    medium: str = KV_MEDIUM_DEVICE


KVCacheEvent = Union[BlockStored, BlockRemoved, AllCleared]
#: Called synchronously, in order, inside the cache call that caused the event; it must not call
#: back into the cache. An exception it raises propagates to the caller of that cache method.
KVEventListener = Callable[[KVCacheEvent], None]


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
    """Abstract prefix cache; the seven abstract members below are the whole v1 surface (the KV
    event methods at the end are concrete and optional: a cache opts in with ``publishes_kv_events``).

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
        change, never the cached content. An unlock releases a lock taken on the same handle (or
        another handle of the same prefix); unlocking one that holds none, such as a never-locked
        prefix of a locked handle, raises ``InvalidArgumentError`` and changes nothing (the
        built-in caches do; a cache that accepted it would under-count the longer handle's lock).
        """

    @abstractmethod
    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        """Cache ``input_ids`` with their locations.

        Args:
            input_ids: shape ``[n]``, int32, cache device; ``n`` a multiple of the page size.
            indices: shape ``[n]``, int32, cache device; the locations holding their K/V: distinct
                and non-negative (anything else raises ``InvalidArgumentError``, nothing cached).
                Those of the already-cached prefix are duplicates the caller frees: the built-in
                caches neither read nor check them (validation costs O(new pages)).

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

    #: ``True`` for a cache kvplug ships and tests (the built-ins): a ``KVBackend`` uses its answers
    #: as they are. Any other cache is wrapped in ``kvplug.prefix_cache.checked.CheckedPrefixCache``,
    #: which checks every answer where kvplug receives it (additive to version 1).
    trusted: ClassVar[bool] = False

    # ------------------------------------------------------------------ KV cache events (optional)
    #: ``True`` for a cache that reports its pages to listeners through ``emit_kv_event``: every
    #: page it starts caching (``BlockStored``, once, when it enters the cache), every page it
    #: drops (``BlockRemoved``, once, with the hashes it was stored under) and every ``reset``
    #: (``AllCleared``). Replaying the events then always yields exactly the cached pages.
    publishes_kv_events: ClassVar[bool] = False

    def add_kv_event_listener(self, listener: KVEventListener) -> bool:
        """Report this cache's KV events to ``listener`` from now on.

        Returns ``False`` (and registers nothing) for a cache that does not publish events, e.g. a
        plugin written before they existed; the host then has no events from it. Pages cached
        before the listener was added are not replayed: add listeners before the first insert.
        """
        if not callable(listener):
            from kvplug.interface.errors import InvalidArgumentError

            raise InvalidArgumentError(f"a KV event listener must be callable, got {listener!r}")
        if not self.publishes_kv_events:
            return False
        self.__dict__.setdefault("_kv_event_listeners", []).append(listener)
        return True

    def remove_kv_event_listener(self, listener: KVEventListener) -> None:
        """Stop reporting to ``listener`` (no-op when it is not registered)."""
        listeners = self.__dict__.get("_kv_event_listeners", [])
        if listener in listeners:
            listeners.remove(listener)

    @property
    def has_kv_event_listeners(self) -> bool:
        """Whether any listener is registered (implementations skip building events otherwise)."""
        return bool(self.__dict__.get("_kv_event_listeners"))

    def emit_kv_event(self, event: KVCacheEvent) -> None:
        """For implementations: hand ``event`` to every listener, in registration order."""
        for listener in tuple(self.__dict__.get("_kv_event_listeners", ())):
            listener(event)
