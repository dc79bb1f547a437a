"""The host-memory tier of the ``radix`` tree: where evicted prefixes' bytes go, and how they come back.

Why a policy object: the tree (``radix``) owns nodes, locks, sizes and candidates of both tiers;
``HostTier`` owns only the bytes: the host page pool, the host copies and the loads in flight. The
write-backs one ``evict`` queues are not the tier's: they are a ``WriteBacks`` that evict gets from
``begin_evict`` and hands back to ``finish_evict`` (``write_backs``). The tree calls the tier at
the points ``TierPolicy`` names; the tier changes the tree only through the tree's tier-facing
methods (``set_host_resident``, ``set_device_resident``, ``drop_subtree``, ``pop_host_candidate``,
``refresh``).

Policy: write-back on eviction. When the device tier must free pages (``evict``), the least
recently used unlocked device leaf is copied to host memory (device -> host, on the compute
stream, so stream order guarantees the copy reads the pages before any later kernel overwrites
them and the device pages are free at once) and stays in the tree as host-resident; the copies
of one evict are issued together at its end. Nothing is copied while the pool has room: a prefix
that is never evicted costs nothing, and the copy happens exactly when its bytes would otherwise
be lost. When host memory is short the least recently used
unlocked host-resident leaves are dropped (and, if that still cannot make room, the evicted node
itself is dropped, as plain ``radix`` would).

A loaded prefix keeps its host pages as the node's *host copy* (``RadixNode.host_copy``): a cached
prefix's K/V never changes, so evicting the node again makes it host-resident on its copy with no
write-back (a multi-turn chat then writes back only each turn's new pages). Copies hold host pages
only (accounting and locks follow ``value``) and are the first to give them up when host memory is
short, oldest first (their bytes are still on the device). An insert whose path runs through
host-resident nodes makes them device-resident with the caller's own pages, keeping their host
pages as copies the same way (``adopt``).

Store writes (issue 30, ``remote_tier``): a write queued for the shared store reads its host pages
after ``evict`` returns, so they are pinned (``HostPagePins``): a pinned page the tier frees is
parked, and comes back to the pool at the next ``reserve_host_pages`` after the write released it.

Loads: a started load's nodes are *in flight* until its copy completes (``loads_in_flight``).
Faults: a load that raises (``TierCopyError``) changes nothing; a write-back that raises drops the
nodes it was writing (their device pages were freed anyway), so no node points at bytes that were
not copied. Locked nodes are never dropped.

Locations. Device locations come in as int32 tensors on the CPU (kvplug's core) or on the KV
pool's device; the pool uploads host arrays itself through pinned memory without a host wait
(``HostKVPool``). Host locations are ``h * page_size + i`` for token ``i`` of host page ``h``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvplug.interface import (
    KV_MEDIUM_DEVICE,
    KV_MEDIUM_HOST,
    AllCleared,
    BaseCacheHandle,
    BlockRemoved,
    DeferredWorkError,
    HostLoad,
    InvalidArgumentError,
    SizeInfo,
    TierCopyError,
    TierStats,
)
from kvplug.memory.host_pool import HostKVPool
from kvplug.prefix_cache.host_pins import HostPagePins
from kvplug.prefix_cache.radix_arguments import location_array
from kvplug.prefix_cache.radix_keys import BYTES_PER_TOKEN, as_int32
from kvplug.prefix_cache.radix_node import RadixNode
from kvplug.prefix_cache.radix_tier import TierPolicy
from kvplug.prefix_cache.validation import check_location_values
from kvplug.prefix_cache.write_backs import WriteBacks

logger = logging.getLogger(__name__)


class HostTier(TierPolicy):
    """Host memory under one radix tree (see the module docstring).

    Args:
        tree: the ``RadixPrefixCache`` this tier serves (it calls back into it).
        host_memory: bytes of host memory for the tier's pages (allocated by ``attach_kv_pool``).
    """

    def __init__(self, tree, host_memory: int) -> None:
        self.tree = tree
        self.host_memory = host_memory
        self.pool: HostKVPool | None = None
        self._open: WriteBacks | None = None  # the one evict's write-backs not handed back yet (misuse check only)
        self._copies: dict[RadixNode, None] = {}  # device-resident nodes with a host copy (an ordered set)
        self._in_flight: dict[RadixNode, HostLoad] = {}  # nodes a started load may still be writing
        self._host_copy_tokens = 0  # their tokens: tier_stats() runs every step, so no walk over them
        self.remote = None  # a RemoteTierLink to a shared KV store (issue 30), set by the cache
        self.pins = HostPagePins()  # host pages queued store writes still read (issue 30)
        self._counters = dict(loads=0, loaded_tokens=0, loaded_bytes=0, write_backs=0, written_tokens=0,
                              written_bytes=0, host_dropped_tokens=0, reused_copy_tokens=0, copy_failures=0)

    # ------------------------------------------------------------------ setup and observation
    def attach_kv_pool(self, pool) -> None:
        """Allocate the host pages for ``pool`` (``kv_buffer`` ``[2, L, num_pages + 1, page_size, H, D]``)."""
        if self.pool is not None:
            raise InvalidArgumentError("this tiered cache already has a KV pool attached")
        tree = self.tree
        kv_buffer = getattr(pool, "kv_buffer", None)
        if not isinstance(kv_buffer, torch.Tensor) or kv_buffer.dim() != 6 or kv_buffer.shape[3] != tree.page_size:
            raise InvalidArgumentError(
                f"expected a KV pool with kv_buffer [2, num_layers, num_pages + 1, page_size={tree.page_size}, "
                f"heads, head_dim], got {type(pool).__name__} with {getattr(kv_buffer, 'shape', None)}"
            )
        # A cache on the CPU keeps locations as host integers and the copies run on the pool's own
        # device, so it can drive a pool anywhere; a cache on an accelerator works on the pool's device only.
        if tree.device.type != "cpu" and kv_buffer.device.type != tree.device.type:
            raise InvalidArgumentError(f"the KV pool is on {kv_buffer.device}, the cache on {tree.device}")
        page_bytes = kv_buffer[:, :, 0].numel() * kv_buffer.element_size()
        num_pages = self.host_memory // page_bytes
        if num_pages < 1:
            raise InvalidArgumentError(
                f"host_memory={self.host_memory:,} bytes holds no KV page of {page_bytes:,} bytes "
                f"(all layers, K and V, {tree.page_size} tokens)"
            )
        self.pool = HostKVPool(kv_buffer, int(num_pages))

    def attach_host_pool(self, pool) -> None:
        """Use ``pool``, built by the host, as the host page pool: a host whose KV bytes live in
        another process (vLLM's workers) passes one that records the copies it is asked for."""
        if self.pool is not None:
            raise InvalidArgumentError("this tiered cache already has a host pool attached")
        if getattr(pool, "page_size", None) != self.tree.page_size or getattr(pool, "num_pages", 0) < 1:
            raise InvalidArgumentError(
                f"expected a host pool of page_size={self.tree.page_size} with at least one page, got "
                f"{type(pool).__name__} of page_size={getattr(pool, 'page_size', None)}, "
                f"num_pages={getattr(pool, 'num_pages', None)}"
            )
        self.pool = pool

    def stats(self, host_sizes: SizeInfo) -> TierStats:
        pool = self.pool
        return TierStats(
            host_pages=pool.num_pages if pool else 0,
            host_free_pages=pool.num_free_pages if pool else 0,
            page_size=self.tree.page_size,
            host_evictable_tokens=host_sizes.evictable_size,
            host_protected_tokens=host_sizes.protected_size,
            host_copy_tokens=self._host_copy_tokens,
            load_seconds=pool.read_seconds if pool else 0.0,
            write_seconds=pool.write_seconds if pool else 0.0,
            **self._counters,
            **(self.remote.counters() if self.remote is not None else {}),
        )

    # ------------------------------------------------------------------ TierPolicy
    def begin_evict(self) -> WriteBacks:
        if self._open is not None:
            raise DeferredWorkError(
                f"expected the write-backs of the previous evict to be handed back (finish_evict), got "
                f"{len(self._open)} queued copies never taken: their host pages hold no bytes"
            )
        self._open = write_backs = WriteBacks()
        return write_backs

    def keep_evicted(self, leaf: RadixNode, write_backs: WriteBacks) -> bool:
        if write_backs is not self._open:
            self._refuse(write_backs)
        if self.pool is None:
            return False
        if leaf.host_copy is not None:
            self._move_to_host_copy(leaf)
            return True
        host_pages = self.reserve_host_pages(len(leaf.value) // (self.tree.page_size * BYTES_PER_TOKEN))
        if host_pages is None:
            return False
        self._move_to_host(leaf, host_pages, write_backs)
        return True

    def finish_evict(self, write_backs: WriteBacks) -> None:
        """Take ``write_backs`` and copy them in one gather and as few copies as the host pages allow."""
        if write_backs is not self._open:
            self._refuse(write_backs)
        entries = write_backs.take()
        self._open = None
        if not entries:
            return
        tree = self.tree
        nodes = [entry.node for entry in entries]
        written = [(entry.node, entry.host_pages) for entry in entries] if self.remote is not None else None
        device_locations = as_int32(b"".join(entry.device_locations for entry in entries))  # host: whole pages
        host_pages = np.concatenate([entry.host_pages for entry in entries])
        try:
            ticket = self.pool.write(device_locations, host_pages)
        except TierCopyError as error:
            self._counters["copy_failures"] += 1
            logger.warning("kvplug host tier: %s; dropping the %d prefix node(s) it was writing", error, len(nodes))
            for node in nodes:
                if node.parent is not None:  # not dropped with an ancestor already
                    tree.refresh(tree.drop_subtree(node))
            return
        counters = self._counters
        counters["write_backs"] += len(nodes)
        counters["written_tokens"] += int(host_pages.size) * tree.page_size
        counters["written_bytes"] += int(host_pages.size) * self.pool.bytes_per_page
        if written is not None:
            self.remote.write_back(written, ticket)  # issue 30: through to the shared store, never waiting

    @staticmethod
    def _refuse(write_backs: WriteBacks) -> None:
        raise DeferredWorkError(
            f"expected the write-backs this tier's begin_evict handed out for the evict under way, got "
            f"{'ones already taken' if write_backs.taken else 'ones it did not hand out'} "
            f"({len(write_backs)} copies); nothing was changed"
        )

    def on_split(self, upper: RadixNode, lower: RadixNode, at_bytes: int) -> None:
        if lower.host_copy is not None:  # pages split at the same place: host copies are whole pages too
            upper.host_copy, lower.host_copy = lower.host_copy[:at_bytes], lower.host_copy[at_bytes:]
            self._copies[upper] = None
        load = self._in_flight.get(lower)
        if load is not None:  # both halves are written by the same copy
            self._in_flight[upper] = load

    def adopt(self, node: RadixNode, head: RadixNode, device_locations: bytes) -> list[RadixNode]:
        tree = self.tree
        path = []
        walker = node
        while walker is not head:
            path.append(walker)
            walker = walker.parent
        path.reverse()
        offset = 0
        for moving in path:
            size = len(moving.value)
            moving.host_copy = moving.value
            self._copies[moving] = None
            self._host_copy_tokens += size // BYTES_PER_TOKEN
            tree.set_device_resident(moving, device_locations[offset : offset + size])
            offset += size
        for moved in reversed(path):
            tree.refresh(moved)
        tree.refresh(head)
        return path

    def on_drop(self, node: RadixNode) -> None:
        if node.on_host:
            tokens = len(node.value) // BYTES_PER_TOKEN
            self._counters["host_dropped_tokens"] += tokens
            # a write-back of this node still queued is not made (``WriteBacks.take`` skips it);
            # pages a store write still reads are parked until it is done (``HostPagePins``)
            self.pins.free(self.pool, self._host_pages(node.value))
        elif node.host_copy is not None:
            self._drop_host_copy(node)

    def reset(self) -> None:
        self._in_flight.clear()  # their requests still order the loads before reading (allocator)
        self._open = None  # a reset is never inside an evict: a dropped queue is forgotten with the tree
        self._copies.clear()
        self._host_copy_tokens = 0
        if self.pool is not None:
            self.pool.reset()
            self.pins.after_reset(self.pool)  # pages queued store writes read stay out of the pool
            if self.tree.has_kv_event_listeners:
                self.tree.emit_kv_event(AllCleared(KV_MEDIUM_HOST))

    # ------------------------------------------------------------------ loading
    def load(self, host_handle: BaseCacheHandle, device_indices: torch.Tensor, *, wait: bool) -> HostLoad:
        """``load_host_prefix`` (``wait``) / ``start_host_load``: see ``BaseTieredPrefixCache``.

        Args:
            device_indices: shape ``[host_len]``, int32, on the CPU (the cache's device) or on the
                KV pool's device (copied to the host first, which synchronises with it).
        """
        tree = self.tree
        node = tree.live_node(host_handle)
        head = tree.device_head(node)
        host_len = node.cached_len - head.cached_len
        devices = [tree.device, torch.device("cpu")]
        if self.pool is not None:
            devices.append(self.pool.device)
        device_locations = location_array(device_indices, tuple(dict.fromkeys(devices)), host_len, "device_indices")
        if host_len == 0:
            return HostLoad(node, None)
        check_location_values(device_locations)
        host_locations = as_int32(b"".join(_path_values(node, head)))
        host_pages = host_locations[:: tree.page_size].astype(np.int64) // tree.page_size
        # TierCopyError: nothing changed
        done = self.pool.read(host_pages, device_locations, wait=wait)
        moved = self.adopt(node, head, device_locations.tobytes())
        load = HostLoad(node, done)
        if done is not None:
            self._forget_finished_loads()
            for moving in moved:
                self._in_flight[moving] = load
        counters = self._counters
        counters["loads"] += 1
        counters["loaded_tokens"] += host_len
        counters["loaded_bytes"] += len(host_pages) * self.pool.bytes_per_page
        return load

    def loads_in_flight(self, handle: BaseCacheHandle) -> tuple[HostLoad, ...]:
        in_flight = self._in_flight
        if not in_flight:  # the common case, at every admission: one dict test
            return ()
        tree = self.tree
        loads: list[HostLoad] = []
        node = tree.live_node(handle)
        while node.parent is not None:  # the path's depth in nodes, only while loads are in flight
            load = in_flight.get(node)
            if load is not None:
                if load.ready():
                    del in_flight[node]
                elif not any(load is known for known in loads):
                    loads.append(load)
            node = node.parent
        return tuple(loads)

    def _forget_finished_loads(self) -> None:
        """Drop the in-flight entries of completed loads (and of nodes no longer in the tree)."""
        in_flight = self._in_flight
        if in_flight:
            for node in [node for node, load in in_flight.items() if node.parent is None or load.ready()]:
                del in_flight[node]

    # ------------------------------------------------------------------ moves
    def _move_to_host(self, leaf: RadixNode, host_pages: np.ndarray, write_backs: WriteBacks) -> None:
        """``leaf`` (device-resident, unlocked, taken by ``evict``) becomes host-resident at
        ``host_pages`` (shape ``[pages]``, int64, host); its copy is queued in ``write_backs``."""
        tree = self.tree
        reporting = tree.has_kv_event_listeners
        if reporting:
            tree.emit_kv_event(BlockRemoved(tree.page_hashes(leaf), KV_MEDIUM_DEVICE))
        size = tree.page_size
        host_locations = (host_pages[:, None] * size + np.arange(size)).astype(np.int32).reshape(-1)
        write_backs.add(leaf, leaf.value, host_pages)
        tree.set_host_resident(leaf, host_locations.tobytes())
        if reporting:
            tree.report_stored(leaf)

    def _move_to_host_copy(self, leaf: RadixNode) -> None:
        """``leaf`` (device-resident, unlocked, taken by ``evict``, with a host copy) becomes
        host-resident on its copy: no bytes move."""
        tree = self.tree
        if tree.has_kv_event_listeners:
            tree.emit_kv_event(BlockRemoved(tree.page_hashes(leaf), KV_MEDIUM_DEVICE))  # its host block stays
        del self._copies[leaf]
        host_value, leaf.host_copy = leaf.host_copy, None
        tokens = len(host_value) // BYTES_PER_TOKEN
        self._host_copy_tokens -= tokens
        self._counters["reused_copy_tokens"] += tokens
        tree.set_host_resident(leaf, host_value)

    def _drop_host_copy(self, node: RadixNode) -> None:
        """Release ``node``'s host copy (its bytes stay on the device)."""
        tree = self.tree
        if tree.has_kv_event_listeners:
            tree.emit_kv_event(BlockRemoved(tree.page_hashes(node), KV_MEDIUM_HOST))
        del self._copies[node]
        self._host_copy_tokens -= len(node.host_copy) // BYTES_PER_TOKEN
        self.pins.free(self.pool, self._host_pages(node.host_copy))
        node.host_copy = None

    def reserve_host_pages(self, count: int) -> np.ndarray | None:
        """``count`` host pages, dropping least recently used host leaves as needed; ``None`` when
        even that cannot free them (everything left is locked, or the tier is smaller)."""
        pool = self.pool
        if count > pool.num_pages:
            return None
        self.pins.reclaim(pool)  # the one place pages are taken: pages store writes are done with come back
        if pool.num_free_pages < count and self._copies:
            # copies first, least recently used first: their bytes are still on the device
            for node in sorted(self._copies, key=_last_access):
                self._drop_host_copy(node)
                if pool.num_free_pages >= count:
                    break
        tree = self.tree
        while pool.num_free_pages < count:
            leaf = tree.pop_host_candidate()
            if leaf is None:
                return None
            tree.refresh(tree.drop_subtree(leaf))
        return pool.take(count)

    def _host_pages(self, host_value: bytes) -> np.ndarray:
        page_size = self.tree.page_size
        return as_int32(host_value)[::page_size].astype(np.int64) // page_size

    # ------------------------------------------------------------------ integrity
    def check_integrity(self, nodes: Sequence[RadixNode]) -> None:
        """Host locations are whole host pages, each held by one node (as its host-resident value
        or as a device-resident node's host copy) or free in the host pool, never both (held + free
        == host pages); host copies only on device-resident nodes, as long as their value, and
        exactly the nodes listed as having one; no evict's write-backs left untaken. Pages parked
        for a store write (``HostPagePins``) count as neither held nor free, and are pinned."""
        assert self._open is None, f"an evict's {len(self._open)} write-back(s) were never taken (finish_evict)"
        page_size = self.tree.page_size
        held: list[bytes] = []
        copies: list[RadixNode] = []
        for node in nodes:
            if node.on_host:
                held.append(node.value)
            if node.host_copy is not None:
                assert not node.on_host, f"{node!r} is host-resident and has a host copy"
                assert len(node.host_copy) == len(node.value), f"{node!r}: its host copy is not as long as its value"
                copies.append(node)
                held.append(node.host_copy)
        pool = self.pool
        if pool is None:
            assert not held, "host-resident nodes without a host pool"
        else:
            host = as_int32(b"".join(held)).astype(np.int64)
            pages = host[::page_size] // page_size
            expected = np.repeat(pages, page_size) * page_size + np.tile(np.arange(page_size), pages.size)
            assert np.array_equal(host, expected), "a host-resident node's (or host copy's) locations are not whole host pages"
            free = pool.free_pages()
            parked = self.pins.parked_pages
            assert all(self.pins.is_pinned(page) for page in parked), "a parked host page is not pinned"
            assert not any(self.pins.is_pinned(page) for page in free), "a pinned host page is free"
            held_and_free = np.concatenate([pages, free, parked])
            assert np.unique(held_and_free).size == held_and_free.size, "a host page is held twice (or held and free)"
            assert held_and_free.size == pool.num_pages, (
                f"host conservation broken: {pages.size} held + {free.size} free + {parked.size} parked != "
                f"{pool.num_pages} host pages"
            )
            assert held_and_free.size == 0 or (held_and_free.min() >= 0 and held_and_free.max() < pool.num_pages), (
                "a host page number lies outside the host pool"
            )
        assert set(copies) == set(self._copies) and len(copies) == len(self._copies), (
            f"{len(copies)} nodes hold a host copy, the tier lists {len(self._copies)}"
        )
        copy_tokens = sum(node.num_tokens for node in copies)
        assert copy_tokens == self._host_copy_tokens, (
            f"the tier counts {self._host_copy_tokens} host-copy tokens, its host copies hold {copy_tokens}"
        )


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
