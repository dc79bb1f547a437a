"""``radix`` with ``host_memory=...``: the radix tree over two tiers, the KV pool and host memory.

Selected by name and option in every host: ``create_prefix_cache("radix", host_memory="32GiB")``,
``kvplug serve --prefix-cache radix --host-memory 32GiB``, ``create_backend(...,
prefix_cache=("radix", {"host_memory": "32GiB"}))``. The tier's page pool is allocated when the
host attaches the KV pool (``attach_kv_pool``; ``create_backend`` does it).

Policy: write-back on eviction. When the device tier must free pages (``evict``), the least
recently used unlocked device leaf is copied to host memory (device -> host, on the compute
stream, so stream order guarantees the copy reads the pages before any later kernel overwrites
them and the device pages are free at once) and stays in the tree as host-resident. A node's
subtree below a host-resident node is host-resident too, so every path is a device-resident head
followed by a host-resident tail. Nothing is copied while the pool has room: a prefix that is never
evicted costs nothing (write-through would copy every finished prefix, most of which a 4x-larger
host tier would hold anyway but which a small tier could not keep), and the copy happens exactly
when its bytes would otherwise be lost. When host memory is short the least recently used
unlocked host-resident leaves are dropped (and, if that still cannot make room, the evicted node
itself is dropped, as plain ``radix`` would).

A hit on host-resident pages (``match_tiered``) is loaded back (``load_host_prefix``, or
``start_host_load`` for a host that keeps the request out of its batches until the copy is done)
into device pages the caller takes for it, before the prefill that reads them, and the nodes become
device-resident at once. While a started load copies, its nodes are *in flight*
(``loads_in_flight``): a request whose match reaches them orders that load before its forwards
too, so no forward reads a page before its bytes arrive. Their host pages stay as the node's *host copy* (``RadixNode.host_copy``): a
cached prefix's K/V never changes, so when the node is evicted again it becomes host-resident on
its copy with no write-back. In a multi-turn chat that halves the bytes moved per turn (each turn
loads its context and, later, evicts it again; only the turn's new pages are written). Each node
still lives in exactly one tier for accounting and locking (sizes, candidates and locks follow
``value``); copies only hold host pages, and are the first to give them up when host memory is
short, oldest first (their bytes are still on the device, so dropping one loses nothing).
An insert whose path runs through host-resident nodes makes them device-resident with the caller's
own (freshly computed) pages instead of copying, keeping their host pages as copies the same way:
it reports only the device-resident head as ``cached_len``, so the caller keeps those pages.

Faults: a load that raises (``TierCopyError``) changes nothing, the prefix stays host-resident; a
write-back that raises drops the nodes it was writing (their device pages were freed anyway), so no
node ever points at bytes that were not copied. Locked nodes (a request using them, or a load
being prepared) are never dropped.

The version-1 face is the device tier's (``kvplug.interface.tiered_cache``): ``match_prefix``
returns the device-resident head, ``size_info`` counts device tokens, ``evict`` frees device tokens;
so the version-1 conformance kit runs unchanged against it, with a pool attached.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from kvplug.interface import (
    KV_MEDIUM_DEVICE,
    KV_MEDIUM_HOST,
    AllCleared,
    BaseCacheHandle,
    BaseTieredPrefixCache,
    BlockRemoved,
    BlockStored,
    HostLoad,
    InsertResult,
    InvalidArgumentError,
    MatchResult,
    PrefixCacheConfig,
    SizeInfo,
    TierCopyError,
    TieredMatchResult,
    TierStats,
)
from kvplug.memory.capacity import parse_memory_size
from kvplug.memory.host_pool import HostKVPool
from kvplug.prefix_cache.radix import RadixPrefixCache
from kvplug.prefix_cache.radix_candidates import EvictionCandidates
from kvplug.prefix_cache.radix_arguments import checked_host_insert_tokens, checked_host_tokens
from kvplug.prefix_cache.radix_keys import (
    BYTES_PER_TOKEN,
    as_int32,
    dense_host_nbytes,
    locations_tensor,
    tensor_bytes,
)
from kvplug.prefix_cache.radix_node import RadixNode
from kvplug.prefix_cache.tiered_integrity import check_tiered_radix_tree
from kvplug.prefix_cache.validation import (
    check_location_values,
    checked_evict_size,
    reject_unlock_flag,
)
from kvplug.tensor_checks import check_int32_vector

logger = logging.getLogger(__name__)
_new_tuple = tuple.__new__


class TieredRadixPrefixCache(RadixPrefixCache, BaseTieredPrefixCache):
    """The radix tree with a host-memory tier (see the module docstring).

    Options: ``host_memory`` (bytes, or a string like ``"32GiB"``; required), and the ``radix``
    options (``split_refreshes_tail``).
    """

    publishes_kv_events = True

    def __init__(self, config: PrefixCacheConfig) -> None:
        options = dict(config.options)
        if "host_memory" not in options:
            raise InvalidArgumentError(f"the tiered radix cache needs the option host_memory, got {dict(config.options)}")
        self.host_memory = parse_memory_size(options.pop("host_memory"))
        self._host_pool: HostKVPool | None = None
        self._host_candidates = EvictionCandidates("host_heap_seq", "host-resident leaves")
        self._host_evictable = 0
        self._host_protected = 0
        self._pending: dict[RadixNode, tuple[bytes, np.ndarray]] = {}  # write-backs not yet copied
        self._copies: dict[RadixNode, None] = {}  # device-resident nodes with a host copy (an ordered set)
        self._in_flight: dict[RadixNode, HostLoad] = {}  # nodes a started load may still be writing
        self._host_copy_tokens = 0  # their tokens: tier_stats() runs every step, so no walk over them
        self._counters = dict(loads=0, loaded_tokens=0, loaded_bytes=0, write_backs=0, written_tokens=0,
                              written_bytes=0, host_dropped_tokens=0, reused_copy_tokens=0, copy_failures=0)
        super().__init__(dataclasses.replace(config, options=options))

    # ------------------------------------------------------------------ tier setup and observation
    @property
    def host_pool(self) -> HostKVPool | None:
        """The host page pool, ``None`` before ``attach_kv_pool``."""
        return self._host_pool

    def attach_kv_pool(self, pool) -> None:
        if self._host_pool is not None:
            raise InvalidArgumentError("this tiered cache already has a KV pool attached")
        kv_buffer = getattr(pool, "kv_buffer", None)
        if not isinstance(kv_buffer, torch.Tensor) or kv_buffer.dim() != 6 or kv_buffer.shape[3] != self.page_size:
            raise InvalidArgumentError(
                f"expected a KV pool with kv_buffer [2, num_layers, num_pages + 1, page_size={self.page_size}, "
                f"heads, head_dim], got {type(pool).__name__} with {getattr(kv_buffer, 'shape', None)}"
            )
        # A cache on the CPU keeps locations as host integers and the copies run on the pool's own
        # device, so it can drive a pool anywhere (the SGLang adapter's caches live on the CPU over a
        # CUDA pool); a cache on an accelerator works on the pool's device only.
        if self.device.type != "cpu" and kv_buffer.device.type != self.device.type:
            raise InvalidArgumentError(f"the KV pool is on {kv_buffer.device}, the cache on {self.device}")
        page_bytes = kv_buffer[:, :, 0].numel() * kv_buffer.element_size()
        num_pages = self.host_memory // page_bytes
        if num_pages < 1:
            raise InvalidArgumentError(
                f"host_memory={self.host_memory:,} bytes holds no KV page of {page_bytes:,} bytes "
                f"(all layers, K and V, {self.page_size} tokens)"
            )
        self._host_pool = HostKVPool(kv_buffer, int(num_pages))

    @property
    def host_size_info(self) -> SizeInfo:
        return SizeInfo(evictable_size=self._host_evictable, protected_size=self._host_protected)

    def tier_stats(self) -> TierStats:
        pool = self._host_pool
        return TierStats(
            host_pages=pool.num_pages if pool else 0,
            host_free_pages=pool.num_free_pages if pool else 0,
            page_size=self.page_size,
            host_evictable_tokens=self._host_evictable,
            host_protected_tokens=self._host_protected,
            host_copy_tokens=self._host_copy_tokens,
            load_seconds=pool.read_seconds if pool else 0.0,
            write_seconds=pool.write_seconds if pool else 0.0,
            **self._counters,
        )

    # ------------------------------------------------------------------ version-1 surface
    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        return _new_tuple(MatchResult, (self.match_tiered(input_ids).handle,))

    def match_tiered(self, input_ids: torch.Tensor) -> TieredMatchResult:
        end = dense_host_nbytes(input_ids) if self._on_cpu else -1
        if end >= 0:
            tokens = input_ids
        else:
            tokens = checked_host_tokens(input_ids, self.device, self.page_size)
            end = tokens.nbytes
        node, _ = self._descend(tokens.data_ptr(), end - end % self._page_bytes)
        self._touch_path(node)
        head = self._device_head(node)
        return TieredMatchResult(head, node, node.cached_len - head.cached_len)

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        if unlock.__class__ is not bool:
            reject_unlock_flag(unlock)
        node = self._live_node(handle)
        root = self._root
        if node is root:
            return
        step, flips_at = self._count_own_lock(node, handle, unlock)
        moved_device = moved_host = 0
        walker = node
        while walker is not root:
            if walker.lock_ref == flips_at:
                if walker.on_host:
                    moved_host += len(walker.value)
                else:
                    moved_device += len(walker.value)
            walker.lock_ref += step
            walker = walker.parent
        moved_device = step * (moved_device // BYTES_PER_TOKEN)
        moved_host = step * (moved_host // BYTES_PER_TOKEN)
        self._evictable -= moved_device
        self._protected += moved_device
        self._host_evictable -= moved_host
        self._host_protected += moved_host
        self._refresh(node)
        if node.on_host:
            self._refresh(self._device_head(node))

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        if not (self._host_evictable or self._host_protected):
            return super().insert_prefix(input_ids, indices)
        tokens = checked_host_insert_tokens(input_ids, indices, self.device, self.page_size)
        node, _ = self._descend(tokens.data_ptr(), tokens.nbytes)
        if not node.on_host:
            return super().insert_prefix(input_ids, indices)
        head = self._device_head(node)
        # the host-resident part of the path takes the caller's freshly computed pages
        self._make_device_resident(node, head, tensor_bytes(indices, head.cached_len, node.cached_len))
        result = super().insert_prefix(input_ids, indices)
        return _new_tuple(InsertResult, (head.cached_len, result.handle))

    def evict(self, size: int) -> torch.Tensor:
        if self._host_pool is None:
            return super().evict(size)
        size = checked_evict_size(size, self._evictable, self._protected)
        if size == 0:
            return self._empty
        freed: list[bytes] = []
        freed_bytes = 0
        wanted_bytes = size * BYTES_PER_TOKEN
        root = self._root
        while freed_bytes < wanted_bytes:
            leaf = self._candidates.pop_least_recent()
            value = leaf.value
            freed.append(value)
            freed_bytes += len(value)
            self._evictable -= len(value) // BYTES_PER_TOKEN
            parent = leaf.parent
            if leaf.host_copy is not None:
                self._move_to_host_copy(leaf)
                self._refresh(leaf)
            else:
                host_pages = self._reserve_host_pages(len(value) // self._page_bytes)
                if host_pages is None:
                    self._drop_subtree(leaf)
                else:
                    self._move_to_host(leaf, host_pages)
                    self._refresh(leaf)
            if parent is not root:
                self._refresh(parent)
        self._flush_write_backs()
        return locations_tensor(freed, self.device)

    def reset(self) -> None:
        self._host_candidates.clear()
        self._in_flight.clear()  # their requests still order the loads before reading (allocator)
        self._pending.clear()
        self._copies.clear()
        self._host_copy_tokens = 0
        if self._host_pool is not None:
            self._host_pool.reset()
        self._host_evictable = 0
        self._host_protected = 0
        super().reset()
        if self._host_pool is not None and self.__dict__.get("_kv_event_listeners"):
            self.emit_kv_event(AllCleared(KV_MEDIUM_HOST))

    def check_integrity(self) -> None:
        check_tiered_radix_tree(self)

    # ------------------------------------------------------------------ loading
    def load_host_prefix(self, host_handle: BaseCacheHandle, device_indices: torch.Tensor) -> BaseCacheHandle:
        return self._load(host_handle, device_indices, wait=True).handle

    def start_host_load(self, host_handle: BaseCacheHandle, device_indices: torch.Tensor) -> HostLoad:
        return self._load(host_handle, device_indices, wait=False)

    def loads_in_flight(self, handle: BaseCacheHandle) -> tuple[HostLoad, ...]:
        in_flight = self._in_flight
        if not in_flight:  # the common case, at every admission: one dict test
            return ()
        loads: list[HostLoad] = []
        node = self._live_node(handle)
        root = self._root
        while node is not root:  # the path's depth in nodes, only while loads are in flight
            load = in_flight.get(node)
            if load is not None:
                if load.ready():
                    del in_flight[node]
                elif not any(load is known for known in loads):
                    loads.append(load)
            node = node.parent
        return tuple(loads)

    def _load(self, host_handle: BaseCacheHandle, device_indices: torch.Tensor, *, wait: bool) -> HostLoad:
        node = self._live_node(host_handle)
        head = self._device_head(node)
        host_len = node.cached_len - head.cached_len
        check_int32_vector(device_indices, self.device, "device_indices")
        if device_indices.shape[0] != host_len:
            raise InvalidArgumentError(
                f"device_indices must hold the {host_len} host-resident tokens of the handle, "
                f"got {device_indices.shape[0]}"
            )
        if host_len == 0:
            return HostLoad(node, None)
        device_bytes = tensor_bytes(device_indices, 0, host_len)
        check_location_values(as_int32(device_bytes))
        host_locations = as_int32(b"".join(_path_values(node, head)))
        host_pages = host_locations[:: self.page_size].astype(np.int64) // self.page_size
        # TierCopyError: nothing changed
        done = self._host_pool.read(host_pages, as_int32(device_bytes), wait=wait)
        moved = self._make_device_resident(node, head, device_bytes)
        load = HostLoad(node, done)
        if done is not None:
            self._forget_finished_loads()
            for moving in moved:
                self._in_flight[moving] = load
        counters = self._counters
        counters["loads"] += 1
        counters["loaded_tokens"] += host_len
        counters["loaded_bytes"] += len(host_pages) * self._host_pool.bytes_per_page
        return load

    def _forget_finished_loads(self) -> None:
        """Drop the in-flight entries of completed loads (and of nodes no longer in the tree)."""
        in_flight = self._in_flight
        if in_flight:
            for node in [node for node, load in in_flight.items() if node.parent is None or load.ready()]:
                del in_flight[node]

    # ------------------------------------------------------------------ tier moves
    def _device_head(self, node: RadixNode) -> RadixNode:
        """The deepest device-resident node on ``node``'s path (``node`` itself, or the root)."""
        while node.on_host:
            node = node.parent
        return node

    def _make_device_resident(self, node: RadixNode, head: RadixNode, device_bytes: bytes) -> list[RadixNode]:
        """Give the host-resident nodes from below ``head`` down to ``node`` the device locations
        ``device_bytes`` (in path order); their host pages stay as their host copies. Returns
        those nodes."""
        path = []
        walker = node
        while walker is not head:
            path.append(walker)
            walker = walker.parent
        path.reverse()
        reporting = bool(self.__dict__.get("_kv_event_listeners"))
        offset = 0
        for moving in path:
            size = len(moving.value)
            tokens = size // BYTES_PER_TOKEN
            moving.host_copy = moving.value
            self._copies[moving] = None
            self._host_copy_tokens += tokens
            moving.value = device_bytes[offset : offset + size]
            moving.on_host = False
            offset += size
            if moving.lock_ref:
                self._host_protected -= tokens
                self._protected += tokens
            else:
                self._host_evictable -= tokens
                self._evictable += tokens
            if reporting:
                self._report_stored(moving)
        for moved in reversed(path):
            self._refresh(moved)
        self._refresh(head)
        return path

    def _move_to_host(self, leaf: RadixNode, host_pages: np.ndarray) -> None:
        """``leaf`` (device-resident, unlocked, out of the device candidates) becomes host-resident
        at ``host_pages``; the copy is queued (``_flush_write_backs``)."""
        reporting = bool(self.__dict__.get("_kv_event_listeners"))
        if reporting:
            self.emit_kv_event(BlockRemoved(self._page_hashes(leaf)))
        size = self.page_size
        host_locations = (host_pages[:, None] * size + np.arange(size)).astype(np.int32).reshape(-1)
        self._pending[leaf] = (leaf.value, host_pages)
        leaf.value = host_locations.tobytes()
        leaf.on_host = True
        self._host_evictable += len(leaf.value) // BYTES_PER_TOKEN
        if reporting:
            self._report_stored(leaf)

    def _move_to_host_copy(self, leaf: RadixNode) -> None:
        """``leaf`` (device-resident, unlocked, out of the device candidates, with a host copy)
        becomes host-resident on its copy: no bytes move."""
        if self.__dict__.get("_kv_event_listeners"):
            self.emit_kv_event(BlockRemoved(self._page_hashes(leaf)))  # its host block was never removed
        del self._copies[leaf]
        leaf.value = leaf.host_copy
        leaf.host_copy = None
        leaf.on_host = True
        tokens = len(leaf.value) // BYTES_PER_TOKEN
        self._host_copy_tokens -= tokens
        self._host_evictable += tokens
        self._counters["reused_copy_tokens"] += tokens

    def _drop_host_copy(self, node: RadixNode) -> None:
        """Release ``node``'s host copy (its bytes stay on the device)."""
        if self.__dict__.get("_kv_event_listeners"):
            self.emit_kv_event(BlockRemoved(self._page_hashes(node), KV_MEDIUM_HOST))
        del self._copies[node]
        self._host_copy_tokens -= len(node.host_copy) // BYTES_PER_TOKEN
        self._host_pool.release(self._host_pages(node.host_copy))
        node.host_copy = None

    def _report_stored(self, node: RadixNode) -> None:
        parent = node.parent
        parent_hash = self._page_hashes(parent)[-1] if parent is not self._root else None
        self.emit_kv_event(
            BlockStored(
                self._page_hashes(node), parent_hash, tuple(as_int32(node.key).tolist()), self.page_size,
                KV_MEDIUM_HOST if node.on_host else KV_MEDIUM_DEVICE,
            )
        )

    def _flush_write_backs(self) -> None:
        """Copy every queued write-back in one gather and as few copies as the host pages allow."""
        pending = self._pending
        if not pending:
            return
        nodes = list(pending)
        device_locations = as_int32(b"".join(value for value, _ in pending.values()))  # host: whole pages
        host_pages = np.concatenate([pages for _, pages in pending.values()])
        pending.clear()
        try:
            self._host_pool.write(device_locations, host_pages)
        except TierCopyError as error:
            self._counters["copy_failures"] += 1
            logger.warning("kvplug host tier: %s; dropping the %d prefix node(s) it was writing", error, len(nodes))
            for node in nodes:
                if node.parent is not None:  # not dropped with an ancestor already
                    parent = self._drop_subtree(node)
                    if parent is not self._root:
                        self._refresh(parent)
            return
        counters = self._counters
        counters["write_backs"] += len(nodes)
        counters["written_tokens"] += int(host_pages.size) * self.page_size
        counters["written_bytes"] += int(host_pages.size) * self._host_pool.bytes_per_page

    def _reserve_host_pages(self, count: int) -> np.ndarray | None:
        """``count`` host pages, dropping least recently used host leaves as needed; ``None`` when
        even that cannot free them (everything left is locked, or the tier is smaller)."""
        pool = self._host_pool
        if count > pool.num_pages:
            return None
        if pool.num_free_pages < count and self._copies:
            # copies first, least recently used first: their bytes are still on the device
            for node in sorted(self._copies, key=_last_access):
                self._drop_host_copy(node)
                if pool.num_free_pages >= count:
                    break
        root = self._root
        while pool.num_free_pages < count:
            if not len(self._host_candidates):
                return None
            parent = self._drop_subtree(self._host_candidates.pop_least_recent())
            if parent is not root:
                self._refresh(parent)
        return pool.take(count)

    def _drop_subtree(self, node: RadixNode) -> RadixNode:
        """Remove unlocked ``node`` and everything below it (all host-resident) from the tree;
        device tokens of ``node`` are already accounted for by the caller. Returns its parent."""
        parent = node.parent
        del parent.children[node.key[: self._page_bytes]]
        reporting = bool(self.__dict__.get("_kv_event_listeners"))
        stack = [node]
        while stack:
            dropping = stack.pop()
            stack.extend(dropping.children.values())
            if dropping.on_host:
                tokens = len(dropping.value) // BYTES_PER_TOKEN
                self._host_evictable -= tokens
                self._counters["host_dropped_tokens"] += tokens
                self._pending.pop(dropping, None)  # a write-back not copied yet is simply not made
                self._host_pool.release(self._host_pages(dropping.value))
                self._host_candidates.discard(dropping)
            else:
                if dropping.host_copy is not None:
                    self._drop_host_copy(dropping)
                if dropping.heap_seq >= 0:
                    self._candidates.discard(dropping)
            if reporting:
                self.emit_kv_event(
                    BlockRemoved(self._page_hashes(dropping), KV_MEDIUM_HOST if dropping.on_host else KV_MEDIUM_DEVICE)
                )
        stack = [node]
        while stack:  # detach after reporting: a child's hashes chain through its parent's
            dropping = stack.pop()
            stack.extend(dropping.children.values())
            dropping.parent = None
        return parent

    def _host_pages(self, host_value: bytes) -> np.ndarray:
        return as_int32(host_value)[:: self.page_size].astype(np.int64) // self.page_size

    # ------------------------------------------------------------------ candidates
    def _touch_path(self, node: RadixNode) -> None:
        self._clock += 1
        self._stamp_ancestors(node, self._clock)
        self._refresh(node)
        if node.on_host:
            self._refresh(self._device_head(node))

    def _refresh(self, node: RadixNode) -> None:
        """Put ``node`` in (or out of) its tier's eviction candidates, re-ranked by its recency.

        Device candidates: unlocked device-resident nodes whose children are all host-resident
        (the leaves of the device tier). Host candidates: unlocked host-resident leaves.
        """
        if node is self._root or node.parent is None:
            return
        if node.on_host:
            if node.heap_seq >= 0:
                self._candidates.discard(node)
            if node.lock_ref == 0 and not node.children:
                self._host_candidates.add(node)
            elif node.host_heap_seq >= 0:
                self._host_candidates.discard(node)
            return
        if node.host_heap_seq >= 0:
            self._host_candidates.discard(node)
        if node.lock_ref == 0 and all(child.on_host for child in node.children.values()):
            self._candidates.add(node)
        elif node.heap_seq >= 0:
            self._candidates.discard(node)

    def _split(self, child: RadixNode, at_bytes: int) -> RadixNode:
        upper = super()._split(child, at_bytes)
        upper.on_host = child.on_host
        if child.host_copy is not None:  # pages split at the same place: host copies are whole pages too
            upper.host_copy, child.host_copy = child.host_copy[:at_bytes], child.host_copy[at_bytes:]
            self._copies[upper] = None
        load = self._in_flight.get(child)
        if load is not None:  # both halves are written by the same copy
            self._in_flight[upper] = load
        if child.on_host and self._split_refreshes_tail and child.host_heap_seq >= 0:
            self._host_candidates.add(child)
        return upper

    def _path_indices(self, handle: RadixNode) -> torch.Tensor:
        node = self._live_node(handle)
        if node.on_host:
            raise InvalidArgumentError(
                f"the prefix of {handle!r} ends in host memory: load it with load_host_prefix before reading "
                "its locations"
            )
        return super()._path_indices(node)


def _last_access(node: RadixNode) -> int:
    return node.last_access


def _path_values(node: RadixNode, head: RadixNode) -> list[bytes]:
    """The values of the nodes below ``head`` down to ``node``, in path order."""
    values = []
    while node is not head:
        values.append(node.value)
        node = node.parent
    values.reverse()
    return values
