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
import weakref
from typing import Any

import numpy as np
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

    Options: ``host_memory`` (bytes, or a string like ``"32GiB"``; required); ``remote_kv`` (a
    shared KV store's URL, e.g. ``"redis://127.0.0.1:6379/0"``, or a ``kvplug.BaseKVStore``) with
    ``remote_kv_model`` (the model's identity in the store's keys; required with it), issue 30;
    ``remote_kv_writes``: ``"thread"`` (store writes on a writer thread, the default with a KV
    pool on CUDA) or ``"inline"`` (in ``evict`` itself, the default on the CPU; see
    ``store_writer``); ``remote_kv_prefetch_timeout_s`` (how long an admission waits for its
    prompt's ``prefetch`` still running, then a miss; default ``store_reader.DEFAULT_TIMEOUT_S``)
    and ``remote_kv_prefetch_memory`` (bytes or ``"1GiB"`` of store pages staged for queued prompts;
    default a quarter of ``host_memory``: staged pages become host pages at admission); and the
    ``radix`` options (``split_refreshes_tail``).
    """

    publishes_kv_events = True

    def __init__(self, config: PrefixCacheConfig) -> None:
        options = dict(config.options)
        if "host_memory" not in options:
            raise InvalidArgumentError(f"the tiered radix cache needs the option host_memory, got {dict(config.options)}")
        self.host_memory = parse_memory_size(options.pop("host_memory"))
        self._remote_url = options.get("remote_kv") if isinstance(options.get("remote_kv"), str) else None
        self._remote_store, self._remote_model = _remote_options(options.pop("remote_kv", None),
                                                                 options.pop("remote_kv_model", None))
        self._remote_writes = options.pop("remote_kv_writes", None)
        if self._remote_writes not in (None, "thread", "inline"):
            raise InvalidArgumentError(f"remote_kv_writes must be 'thread' or 'inline', got {self._remote_writes!r}")
        if self._remote_writes is not None and self._remote_store is None:
            raise InvalidArgumentError(f"remote_kv_writes={self._remote_writes!r} is given without remote_kv")
        self._prefetch_timeout_s, self._prefetch_memory = _prefetch_options(
            options.pop("remote_kv_prefetch_timeout_s", None), options.pop("remote_kv_prefetch_memory", None),
            self.host_memory, self._remote_store is not None)
        self._host_tier = HostTier(self, self.host_memory)
        super().__init__(dataclasses.replace(config, options=options), tier=self._host_tier)

    @property
    def host_pool(self) -> HostKVPool | None:
        """The host page pool, ``None`` before ``attach_kv_pool``."""
        return self._host_tier.pool

    def attach_kv_pool(self, pool) -> None:
        kv_buffer = getattr(pool, "kv_buffer", None)
        self._host_tier.attach_kv_pool(pool)
        if self._remote_store is not None:
            from kvplug.kv_store.host_pages import namespace_for_pool
            from kvplug.kv_store.remote import RemoteKV
            from kvplug.prefix_cache.remote_tier import RemoteTierLink
            from kvplug.prefix_cache.store_reader import StoreReader
            from kvplug.prefix_cache.store_writer import StoreWriter

            config = getattr(pool, "config", None)
            namespace = namespace_for_pool(self._remote_model, kv_buffer, tp_rank=getattr(config, "tp_rank", 0),
                                           tp_size=getattr(config, "tp_size", 1))
            threaded = (self._remote_writes or ("inline" if kv_buffer.device.type == "cpu" else "thread")) == "thread"
            # a Redis store given by URL gets a second connection for the writer thread, so reads never
            # queue behind writes (a store allowing concurrent_calls needs none; others share one)
            second = threaded and self._remote_url is not None and self._remote_url.startswith("redis://")
            write_store = _remote_options(self._remote_url, self._remote_model)[0] if second else None
            remote = RemoteKV(self._remote_store, namespace, write_store=write_store)
            writer = StoreWriter(remote, self._host_tier.pool, threaded=threaded)
            reader = StoreReader(remote, self._host_tier.pool.bytes_per_page, max_staged_bytes=self._prefetch_memory)
            self._host_tier.remote = RemoteTierLink(self._host_tier, remote, writer, reader, self._prefetch_timeout_s)
            weakref.finalize(self, writer.detach)  # dropped: the writer finishes its queue, no wait here
            weakref.finalize(self, reader.close)  # and the reader drops what it staged

    @property
    def remote_kv(self):
        """The ``kvplug.kv_store.RemoteKV`` under the host tier (``stats`` counts its hits and
        faults), or ``None``: no ``remote_kv`` option, or no KV pool attached yet."""
        link = self._host_tier.remote
        return link.remote if link is not None else None

    def prefetch(self, input_ids: torch.Tensor) -> bool:
        """See ``BaseTieredPrefixCache.prefetch``: the shared store's pages of the prompt are read
        on the store reader's thread (``remote_tier``); ``False`` without a store. Any thread: it
        reads only the link, set once by ``attach_kv_pool``."""
        link = self._host_tier.remote
        if link is None:
            return False
        return link.prefetch(np.ascontiguousarray(torch.as_tensor(input_ids).cpu(), dtype=np.int32).reshape(-1))

    def flush_prefetches(self, timeout_s: float | None = None) -> bool:
        """Wait until every prefetch started so far is staged or dropped (tests, benchmarks; not
        the serving thread); ``True`` without a store, ``False`` when ``timeout_s`` passed first."""
        link = self._host_tier.remote
        return link.reader.flush(timeout_s) if link is not None else True

    def flush_remote_kv(self, timeout_s: float | None = None) -> bool:
        """Wait until every store write queued so far is done (written, dropped or failed): the one
        call a test or benchmark makes before reading the store or ``remote_*`` stats; ``True``
        without a store. ``False`` when ``timeout_s`` passed first. Waits for the device: not on
        the serving path."""
        link = self._host_tier.remote
        return link.writer.flush(timeout_s) if link is not None else True

    def close_remote_kv(self, timeout_s: float | None = None) -> bool:
        """Stop writing to the store: queued writes get up to ``timeout_s`` (default
        ``store_writer.DEFAULT_CLOSE_S``), the rest are dropped (counted); later writes are dropped.
        Reads go on. ``True`` when everything queued was written."""
        link = self._host_tier.remote
        if link is None:
            return True
        from kvplug.prefix_cache.store_writer import DEFAULT_CLOSE_S

        return link.writer.close(DEFAULT_CLOSE_S if timeout_s is None else timeout_s)

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
        link = self._host_tier.remote
        if link is not None:  # issue 30: what neither tier holds may be in the shared store
            node = link.fetch(node, np.asarray(torch.as_tensor(input_ids).cpu(), dtype=np.int32))
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


def _prefetch_options(timeout_s: Any, memory: Any, host_memory: int, remote: bool) -> tuple[float, int]:
    """``remote_kv_prefetch_timeout_s`` and ``remote_kv_prefetch_memory``, validated, defaults filled."""
    from kvplug.prefix_cache.store_reader import DEFAULT_TIMEOUT_S

    for name, value in (("remote_kv_prefetch_timeout_s", timeout_s), ("remote_kv_prefetch_memory", memory)):
        if value is not None and not remote:
            raise InvalidArgumentError(f"{name}={value!r} is given without remote_kv")
    if timeout_s is None:
        timeout_s = DEFAULT_TIMEOUT_S
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s < float("inf"):
        raise InvalidArgumentError(f"remote_kv_prefetch_timeout_s must be a number of seconds >= 0, got {timeout_s!r}")
    memory = host_memory // 4 if memory is None else parse_memory_size(memory)
    return float(timeout_s), int(memory)


def _remote_options(store: Any, model: Any) -> tuple[Any, Any]:
    """The store (built from its URL now, connected at first use) and the model id, validated."""
    if store is None:
        if model is not None:
            raise InvalidArgumentError("remote_kv_model is given without remote_kv")
        return None, None
    if not isinstance(model, str) or not model:
        raise InvalidArgumentError(
            f"remote_kv needs remote_kv_model, the model's identity in the store's keys (a non-empty str), got {model!r}"
        )
    from kvplug.interface import BaseKVStore

    if isinstance(store, str):
        from kvplug.plugins import default_manager

        store = default_manager().create_kv_store(store)
    if not isinstance(store, BaseKVStore):
        raise InvalidArgumentError(f"remote_kv must be a store URL or a kvplug.BaseKVStore, got {type(store).__name__}")
    return store, model
