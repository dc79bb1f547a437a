"""``radix`` with ``host_memory=...``: the radix tree over two tiers, the KV pool and host memory.

Selected by name and option in every host: ``create_prefix_cache("radix", host_memory="32GiB")``,
``kvplug serve --prefix-cache radix --host-memory 32GiB``, ``create_backend(...,
prefix_cache=("radix", {"host_memory": "32GiB"}))``. The tier's page pool is allocated when the
host attaches the KV pool (``attach_kv_pool``; ``create_backend`` does it).

Why so small: the tree (``radix``) already keeps both tiers' nodes, locks, sizes and candidates,
and calls its host tier (``host_tier.HostTier``, the policy: write-back on eviction, host copies,
loads) where bytes move. This class only composes the two and adds the tiered contract
(``kvplug.interface.tiered_cache``); it overrides none of the tree's methods. Its version-1 face is
the device tier's: ``match_prefix`` returns the device-resident head, ``size_info`` counts device
tokens, ``evict`` frees device tokens, so the version-1 conformance kit runs unchanged against it.
"""

from __future__ import annotations

import dataclasses

import torch

from kvplug.interface import (
    BaseCacheHandle,
    BaseTieredPrefixCache,
    HostLoad,
    InvalidArgumentError,
    PrefixCacheConfig,
    SizeInfo,
    TieredMatchResult,
    TierStats,
)
from kvplug.memory.capacity import parse_memory_size
from kvplug.memory.host_pool import HostKVPool
from kvplug.prefix_cache.host_tier import HostTier
from kvplug.prefix_cache.radix import RadixPrefixCache


class TieredRadixPrefixCache(RadixPrefixCache, BaseTieredPrefixCache):
    """The radix tree with a host-memory tier (see the module docstring and ``host_tier``).

    Options: ``host_memory`` (bytes, or a string like ``"32GiB"``; required), and the ``radix``
    options (``split_refreshes_tail``).
    """

    publishes_kv_events = True

    def __init__(self, config: PrefixCacheConfig) -> None:
        options = dict(config.options)
        if "host_memory" not in options:
            raise InvalidArgumentError(f"the tiered radix cache needs the option host_memory, got {dict(config.options)}")
        self.host_memory = parse_memory_size(options.pop("host_memory"))
        self._host_tier = HostTier(self, self.host_memory)
        super().__init__(dataclasses.replace(config, options=options), tier=self._host_tier)

    @property
    def host_pool(self) -> HostKVPool | None:
        """The host page pool, ``None`` before ``attach_kv_pool``."""
        return self._host_tier.pool

    def attach_kv_pool(self, pool) -> None:
        self._host_tier.attach_kv_pool(pool)

    def attach_host_pool(self, pool) -> None:
        """A host page pool built by the host instead of ``attach_kv_pool`` (see ``HostTier.attach_host_pool``)."""
        self._host_tier.attach_host_pool(pool)

    @property
    def host_size_info(self) -> SizeInfo:
        return SizeInfo(evictable_size=self._host_evictable, protected_size=self._host_protected)

    def tier_stats(self) -> TierStats:
        return self._host_tier.stats(self.host_size_info)

    def match_tiered(self, input_ids: torch.Tensor) -> TieredMatchResult:
        node = self._match(input_ids)
        head = self.device_head(node)
        return TieredMatchResult(head, node, node.cached_len - head.cached_len)

    def load_host_prefix(self, host_handle: BaseCacheHandle, device_indices: torch.Tensor) -> BaseCacheHandle:
        """See ``BaseTieredPrefixCache``; ``device_indices`` may be on the CPU or on the pool's device."""
        return self._host_tier.load(host_handle, device_indices, wait=True).handle

    def start_host_load(self, host_handle: BaseCacheHandle, device_indices: torch.Tensor) -> HostLoad:
        """See ``BaseTieredPrefixCache``; ``device_indices`` may be on the CPU or on the pool's device
        (on the CPU the pool uploads them through pinned memory, without a host wait)."""
        return self._host_tier.load(host_handle, device_indices, wait=False)

    def loads_in_flight(self, handle: BaseCacheHandle) -> tuple[HostLoad, ...]:
        return self._host_tier.loads_in_flight(handle)
