"""The optional host-memory tier of a prefix cache: additive to contract version 1.

A *tiered* prefix cache keeps prefixes evicted from the accelerator's KV pool in a second,
larger pool in host memory, and loads them back when a request matches them. Its version-1 face
is unchanged (``BasePrefixCache``): ``match_prefix``, ``size_info``, ``evict`` and the rest speak of
the device tier only, so every caller and test written for version 1 sees an ordinary prefix
cache. A host that knows the tier asks ``isinstance(cache, BaseTieredPrefixCache)`` and uses the
members below; a version-1 plugin is simply not tiered.

Lifecycle a host (``kvplug.memory.allocator.PagedAllocator``) follows::

    cache.attach_kv_pool(pool)                      # once, after the KV pool exists
    match = cache.match_tiered(input_ids)           # device part + host part of the longest prefix
    cache.lock_handle(match.handle)
    if match.host_len:
        cache.lock_handle(match.host_handle)        # nothing on the path can be dropped now
        pages = <take match.host_len // page_size free pages, evicting as usual>
        handle = cache.load_host_prefix(match.host_handle, locations_of(pages))
        cache.lock_handle(match.handle, unlock=True)  # host_handle stays locked, now all on device

A host that can keep a request out of its batches for a while (a continuous-batching scheduler)
starts the load instead (``start_host_load``): the copy runs behind the forwards already queued and
the ones queued meanwhile, and the request joins a batch once ``HostLoad.ready()``; before any
forward that reads the pages the host calls ``HostLoad.order_before()`` (kvplug's ``KVBackend``
does it in ``prepare`` / ``begin_decode``). A later match may reach pages whose load is still in
flight: ``loads_in_flight(handle)`` names those loads, and the same rule applies to them.

KV events of a tiered cache carry the tier in ``medium``: ``KV_MEDIUM_DEVICE`` (``"GPU"``) for the
KV pool, ``KV_MEDIUM_HOST`` (``"CPU"``) for host memory; a move between tiers is a ``BlockRemoved``
in one medium and a ``BlockStored`` in the other.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from kvplug.interface.prefix_cache import BaseCacheHandle, BasePrefixCache, SizeInfo

#: ``medium`` of KV events about pages held in the host-memory tier (SGLang's and vLLM's name).
KV_MEDIUM_HOST = "CPU"


class TieredMatchResult(NamedTuple):
    """Result of ``match_tiered``.

    Attributes:
        handle: the device-resident part of the match, exactly ``match_prefix(...).handle``.
        host_handle: the handle of the whole match (``handle.cached_len + host_len`` tokens);
            ``handle`` itself when ``host_len == 0``. Lock it before making room for a load; its
            ``get_matched_indices`` is valid only once it is loaded.
        host_len: tokens after ``handle`` that are cached in host memory (a page multiple).
    """

    handle: BaseCacheHandle
    host_handle: BaseCacheHandle
    host_len: int


class CopyDone(Protocol):
    """What a started load hands back to say when its copy is complete: a ``torch.cuda.Event``
    recorded after the copy, or anything with the same two members."""

    def query(self) -> bool:
        """Whether the copy has completed (never blocks)."""

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait for the copy; returns at once."""

    def synchronize(self) -> None:
        """Block the calling thread until the copy has completed."""


class HostLoad(NamedTuple):
    """A load of host-resident pages into the KV pool, started by ``start_host_load``.

    Attributes:
        handle: the loaded prefix's handle (all on the device now, in the cache's bookkeeping).
        done: ``None`` when the copy is already ordered before any later work on the current
            stream (a synchronous load, or a cache without asynchronous loads); otherwise the
            copy's completion (``CopyDone``), which must be ordered before any forward reading
            the pages (``order_before``).
    """

    handle: BaseCacheHandle
    done: CopyDone | None

    def ready(self) -> bool:
        """The copy has completed: a forward reading the pages would not wait for it."""
        return self.done is None or bool(self.done.query())

    def order_before(self, stream: Any = None) -> None:
        """Order the copy before everything queued on ``stream`` (default: the current stream)
        from now on; no host wait."""
        if self.done is not None:
            self.done.wait(stream)

    def synchronize(self) -> None:
        """Block until the copy has completed."""
        if self.done is not None:
            self.done.synchronize()


@dataclass(frozen=True)
class TierStats:
    """Counters of a host-memory tier since the cache was built (``reset`` keeps them).

    Attributes:
        host_pages, host_free_pages: pages of the host pool (0 before ``attach_kv_pool``).
        page_size: tokens per page.
        host_evictable_tokens, host_protected_tokens: tokens cached in host memory (protected:
            locked while a load is prepared).
        loads, loaded_tokens, loaded_bytes: host-to-device copies (each a host hit: the tokens
            were not recomputed).
        write_backs, written_tokens, written_bytes: device-to-host copies of evicted prefixes.
        host_dropped_tokens: tokens dropped from host memory (LRU, when it was full).
        host_copy_tokens: device-resident tokens whose host copy is kept (a loaded prefix keeps
            its host pages, so evicting it again moves no bytes); they use host pages, and are the
            first to give them up when host memory is short (the bytes are still on the device).
        reused_copy_tokens: evicted tokens that needed no write-back because their host copy was kept.
        copy_failures: copies that raised (``TierCopyError``); nothing was lost, see there.
        load_seconds, write_seconds: host time spent issuing the copies (on CUDA the copies
            themselves are asynchronous; on the CPU this is the copy time).
        remote_hit_tokens, remote_written_pages, remote_dropped_pages, remote_corrupt_pages,
            remote_errors: a shared KV store under the tier (issue 30; 0 without one): tokens it
            brought into the tier, pages written to it and dropped by it (full or down), values
            that failed their checksum, and store faults (``kvplug.kv_store.RemoteKVStats``);
            dropped pages include those the store writer dropped before writing (its queue full).
        remote_queued_pages: pages handed to the store writer (issue 30); writes are done when
            it equals ``remote_written_pages + remote_dropped_pages`` (on a CUDA pool they land
            after the call that evicted them returns).
        remote_prefetches, remote_prefetch_hit_tokens, remote_prefetch_timeouts,
            remote_prefetch_dropped, remote_prefetch_staged_bytes, remote_blocking_reads: store
            reads made for queued prompts (``prefetch``, issue 30): prefetches started; tokens an
            admission took from staged pages (part of ``remote_hit_tokens``, no store call at
            admission); admissions whose prefetch was still running after the wait (a miss);
            prefetches dropped unused (memory bound, timed out, failed); bytes staged now; and
            admissions that read the store on the serving thread (no prefetch of the prompt).
    """

    host_pages: int = 0
    host_free_pages: int = 0
    page_size: int = 1
    host_evictable_tokens: int = 0
    host_protected_tokens: int = 0
    loads: int = 0
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    write_backs: int = 0
    written_tokens: int = 0
    written_bytes: int = 0
    host_dropped_tokens: int = 0
    host_copy_tokens: int = 0
    reused_copy_tokens: int = 0
    copy_failures: int = 0
    load_seconds: float = 0.0
    write_seconds: float = 0.0
    remote_hit_tokens: int = 0
    remote_written_pages: int = 0
    remote_dropped_pages: int = 0
    remote_corrupt_pages: int = 0
    remote_errors: int = 0
    remote_queued_pages: int = 0
    remote_prefetches: int = 0
    remote_prefetch_hit_tokens: int = 0
    remote_prefetch_timeouts: int = 0
    remote_prefetch_dropped: int = 0
    remote_prefetch_staged_bytes: int = 0
    remote_blocking_reads: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class BaseTieredPrefixCache(BasePrefixCache):
    """A prefix cache with a host-memory tier under its device tier (see the module docstring).

    The version-1 members keep their meaning for the device tier: ``match_prefix`` returns the
    device-resident part of the match, ``size_info`` counts device tokens, ``evict(n)`` frees at
    least ``n`` device tokens (moving them to host memory where it can), ``insert_prefix`` reports
    as ``cached_len`` the device-resident part (host-resident pages on the inserted path take the
    caller's device locations instead of being copied back).
    """

    @abstractmethod
    def attach_kv_pool(self, pool: Any) -> None:
        """Give the cache the KV pool whose pages it moves (``pool.kv_buffer``: shape
        ``[2, num_layers, num_pages + 1, page_size, local_kv_heads, head_dim]``, on the cache's
        device, or on any device for a cache on the CPU: its locations are host integers, as in
        the SGLang host, whose kvplug caches live on the CPU over a pool on the GPU). Until then
        the cache has no host tier and behaves as a version-1 cache."""

    @abstractmethod
    def match_tiered(self, input_ids: torch.Tensor) -> TieredMatchResult:
        """``match_prefix`` that also reports the host-resident continuation of the match.

        Args:
            input_ids: shape ``[n]``, int32, cache device.
        """

    @abstractmethod
    def load_host_prefix(self, host_handle: BaseCacheHandle, device_indices: torch.Tensor) -> BaseCacheHandle:
        """Copy the host-resident part of ``host_handle``'s prefix into the KV pool at
        ``device_indices`` and make it device-resident; returns the handle (now all on device).

        Args:
            host_handle: ``match_tiered(...).host_handle``, locked by the caller.
            device_indices: shape ``[host_len]``, int32, cache device; free locations (whole pages)
                the caller gives to the cache.

        The copy is ordered before any later work on the device's current stream (on CUDA it runs
        on a side stream the current stream waits for). Raises ``TierCopyError`` with nothing
        changed (the prefix stays host-resident; the caller still owns ``device_indices``).
        """

    def start_host_load(self, host_handle: BaseCacheHandle, device_indices: torch.Tensor) -> HostLoad:
        """``load_host_prefix`` whose copy may still be running when it returns (arguments and
        errors the same). The cache is updated at once (the prefix is device-resident, later
        matches find it there); the bytes arrive when ``HostLoad.done`` completes, so nothing may
        read ``device_indices`` before ``HostLoad.order_before`` was called on its stream.

        The default loads synchronously (``done`` is ``None``): a tier written for the first
        revision of this interface keeps working under a host that starts loads. Added to
        contract version 1 without changing anything before it.
        """
        return HostLoad(self.load_host_prefix(host_handle, device_indices), None)

    def loads_in_flight(self, handle: BaseCacheHandle) -> tuple[HostLoad, ...]:
        """The started loads, not known to be complete, that write pages of ``handle``'s prefix
        (a request matching it must order them before its forwards). Default: none."""
        return ()

    def prefetch(self, input_ids: torch.Tensor) -> bool:
        """A request with prompt ``input_ids`` (shape ``[n]``, int32, cpu) was queued: start
        reading what a tier below host memory holds of it, so that its admission (``match_tiered``)
        finds the bytes ready. May be called from any thread (an HTTP handler's) while the serving
        thread uses the cache, so it must never touch the cache's index, and never wait. ``True``:
        a read was started. Default: ``False``, nothing (a tier without a store below it). Added to
        contract version 1 without changing anything before it."""
        return False

    @property
    @abstractmethod
    def host_size_info(self) -> SizeInfo:
        """Tokens cached in host memory: evictable (unlocked) and protected (locked)."""

    @abstractmethod
    def tier_stats(self) -> TierStats:
        """The tier's counters and sizes."""
