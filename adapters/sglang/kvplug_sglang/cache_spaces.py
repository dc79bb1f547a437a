"""Namespaces of the SGLang prefix-cache adapter: one kvplug prefix cache per ``(extra_key, cache_salt)``.

SGLang keys its radix tree by token ids *and* a namespace (``RadixKey.extra_key``, set per LoRA
adapter, and ``cache_salt``): equal token ids in different namespaces never share KV. kvplug's
prefix-cache contract keys by token ids only, so the adapter keeps one kvplug cache per namespace,
created on first use. Nearly every deployment has a single namespace (no LoRA, no salt).

Eviction across namespaces takes from the least recently used namespace first; inside one
namespace the kvplug cache's own policy (LRU for ``radix``) decides.

The default namespace's cache lives as long as the adapter (``reset`` empties it): with a host
tier it owns the host memory, allocated once at startup.

Host-side structures only; nothing here touches a tensor on the accelerator.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterator, Optional

import torch

from kvplug.interface import BaseCacheHandle, BasePrefixCache

Namespace = tuple[Optional[str], Optional[str]]  # (extra_key, cache_salt)
DEFAULT_NAMESPACE: Namespace = (None, None)

_NO_TOKENS = torch.empty(0, dtype=torch.int32)


class CacheSpace:
    """One namespace: its kvplug cache, the handle of its empty prefix (the root) and its recency;
    ``inherited``: the hand-over record once its cache was quarantined (``quarantine``), else ``None``."""

    __slots__ = ("namespace", "cache", "root", "last_used", "inherited")

    def __init__(self, namespace: Namespace, cache: BasePrefixCache) -> None:
        self.namespace = namespace
        self.last_used = 0
        self.inherited = None
        self.replace(cache)

    def replace(self, cache: BasePrefixCache) -> None:
        """Make ``cache`` this namespace's cache (a new root from it)."""
        self.cache = cache
        self.root = CacheNode(self, cache.match_prefix(_NO_TOKENS).handle)


class CacheNode:
    """What SGLang keeps in ``req.last_node`` and passes back to lock, unlock and path lookups:
    a kvplug handle plus the namespace whose cache issued it."""

    __slots__ = ("space", "handle")

    def __init__(self, space: CacheSpace, handle: BaseCacheHandle) -> None:
        self.space = space
        self.handle = handle

    @property
    def cached_len(self) -> int:
        return self.handle.cached_len

    def __repr__(self) -> str:
        return f"CacheNode(namespace={self.space.namespace!r}, cached_len={self.handle.cached_len})"


class CacheSpaces:
    """The namespaces in use, created on demand by ``factory(namespace)`` (a fresh kvplug prefix cache)."""

    def __init__(
        self,
        factory: Callable[[Namespace], BasePrefixCache],
        on_create: Optional[Callable[[CacheSpace], None]] = None,
    ) -> None:
        """``on_create(space)`` runs for each new namespace before its cache is used (events)."""
        self._factory = factory
        self._on_create = on_create
        self._spaces: dict[Hashable, CacheSpace] = {}
        self._clock = 0
        self.get(DEFAULT_NAMESPACE)

    def get(self, namespace: Namespace, *, touch: bool = True) -> CacheSpace:
        """The namespace's space, created on first use; with ``touch`` it counts as a use for the
        cross-namespace LRU order."""
        space = self._spaces.get(namespace)
        if space is None:
            space = CacheSpace(namespace, self._factory(namespace))
            if self._on_create is not None:
                self._on_create(space)
            self._spaces[namespace] = space
        if touch:
            self._clock += 1
            space.last_used = self._clock
        return space

    def __iter__(self) -> Iterator[CacheSpace]:
        return iter(self._spaces.values())

    def least_recently_used_first(self) -> list[CacheSpace]:
        return sorted(self._spaces.values(), key=lambda space: space.last_used)

    def reset(self) -> None:
        """Forget every entry of every namespace; handles issued before are no longer valid. The
        default namespace keeps its (emptied) cache and event listener; the others are dropped."""
        for space in self._spaces.values():
            space.cache.reset()
            if space.inherited is not None:
                space.inherited.forget()
        default = self._spaces[DEFAULT_NAMESPACE].cache
        self._spaces = {DEFAULT_NAMESPACE: CacheSpace(DEFAULT_NAMESPACE, default)}
        self.get(DEFAULT_NAMESPACE)

    def evictable_size(self) -> int:
        return sum(space.cache.size_info.evictable_size for space in self._spaces.values())

    def protected_size(self) -> int:
        return sum(space.cache.size_info.protected_size for space in self._spaces.values())
