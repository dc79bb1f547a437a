"""``radix``: a radix tree over page-aligned token ids, with LRU eviction of unlocked leaves.

Layout. The tree lives on the host whatever the cache's device: token ids and locations are int32
``bytes`` (see ``radix_keys``). Children are keyed by the bytes of their first page, so descending
one edge is one dict lookup plus one memcmp over the whole edge; only a mismatch inside an edge
touches numpy to find where it is. Tensors from the caller are copied to the host once per call
(which synchronises with an accelerator), and locations are copied to the cache's device on the
way out (``get_matched_indices`` and ``evict``).

Recency. A logical clock ticks once per ``match_prefix``/``insert_prefix``; every node on the
path gets the new tick, so a parent is never older than its children and evicting leaves in
clock order is LRU at every depth. Locks count handles per node along the path to the root.

Eviction candidates (unlocked leaves) are kept incrementally in ``EvictionCandidates``: lock,
unlock, insert, split, match and evict each update O(1) of them; ``evict`` never scans the tree.
"""

from __future__ import annotations

import torch

from kvplug.interface import (
    BaseCacheHandle,
    BasePrefixCache,
    InsertResult,
    InvalidArgumentError,
    MatchResult,
    PrefixCacheConfig,
    SizeInfo,
)
from kvplug.prefix_cache.radix_arguments import checked_evict_size, is_valid_tensor, reject
from kvplug.prefix_cache.radix_candidates import EvictionCandidates
from kvplug.prefix_cache.radix_integrity import check_radix_tree
from kvplug.prefix_cache.radix_keys import BYTES_PER_TOKEN, locations_tensor, shared_page_bytes, tensor_bytes
from kvplug.prefix_cache.radix_node import RadixGeneration, RadixNode, stale_handle_error

_new_tuple = tuple.__new__  # builds the NamedTuple results without their Python-level __new__


class RadixPrefixCache(BasePrefixCache):
    """Radix-tree prefix cache (SPEC §4). Takes no options.

    Handles are the tree's nodes (``RadixNode``). Locks are counted per node, as in SGLang: an
    unlock is rejected when no lock is left on the handle's prefix, whichever handle took it.
    """

    def __init__(self, config: PrefixCacheConfig) -> None:
        if config.options:
            raise InvalidArgumentError(f"the radix prefix cache takes no options, got {sorted(config.options)}")
        self.device = config.device  # PrefixCacheConfig names the CUDA index
        self.page_size = config.page_size
        self._on_cpu = self.device.type == "cpu"
        self._page_bytes = config.page_size * BYTES_PER_TOKEN
        self._empty = torch.empty(0, dtype=torch.int32, device=self.device)
        self._candidates = EvictionCandidates()
        self.reset()

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        if not is_valid_tensor(input_ids, self.device, self._on_cpu):
            reject(self.device, self.page_size, input_ids)
        length = input_ids.numel()
        ids = tensor_bytes(input_ids, 0, length - length % self.page_size)
        node, matched_bytes = self._descend(ids)
        self._touch_path(node)
        return _new_tuple(MatchResult, (node,))

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        node = self._live_node(handle)
        root = self._root
        if node is root:
            return
        if unlock and node.lock_ref <= 0:
            raise InvalidArgumentError(f"cannot unlock {handle!r}: it is not locked")
        step, flips_at = (-1, 1) if unlock else (1, 0)
        moved = 0  # bytes of locations whose node flips between evictable and protected
        walker = node
        while walker is not root:
            if walker.lock_ref == flips_at:
                moved += len(walker.value)
            walker.lock_ref += step
            walker = walker.parent
        moved = step * (moved // BYTES_PER_TOKEN)
        self._evictable -= moved
        self._protected += moved
        if not unlock:
            if node.heap_seq >= 0:
                self._candidates.discard(node)
        elif node.lock_ref == 0 and not node.children:
            self._candidates.add(node)

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        device, on_cpu = self.device, self._on_cpu
        valid = is_valid_tensor(input_ids, device, on_cpu) and is_valid_tensor(indices, device, on_cpu)
        length = input_ids.numel() if valid else -1
        if not valid or indices.numel() != length or length % self.page_size:
            reject(device, self.page_size, input_ids, indices)
        ids = tensor_bytes(input_ids, 0, length)
        node, matched_bytes = self._descend(ids)
        cached_len = matched_bytes // BYTES_PER_TOKEN
        if cached_len < length:
            locations = tensor_bytes(indices, cached_len, length)
            leaf = RadixNode(self._generation, node, ids[matched_bytes:], locations, length)
            node.children[ids[matched_bytes : matched_bytes + self._page_bytes]] = leaf
            if node.heap_seq >= 0:
                self._candidates.discard(node)  # it stops being a leaf
            self._evictable += length - cached_len
            node = leaf
        self._touch_path(node)
        return _new_tuple(InsertResult, (cached_len, node))

    def evict(self, size: int) -> torch.Tensor:
        size = checked_evict_size(size, self._evictable, self._protected)
        if size == 0:
            return self._empty
        freed: list[bytes] = []
        freed_bytes = 0
        wanted_bytes = size * BYTES_PER_TOKEN
        root = self._root
        page_bytes = self._page_bytes
        while freed_bytes < wanted_bytes:
            leaf = self._candidates.pop_least_recent()
            parent = leaf.parent
            del parent.children[leaf.key[:page_bytes]]
            leaf.parent = None
            freed.append(leaf.value)
            freed_bytes += len(leaf.value)
            if parent is not root and not parent.children and parent.lock_ref == 0:
                self._candidates.add(parent)
        self._evictable -= freed_bytes // BYTES_PER_TOKEN
        return locations_tensor(freed, self.device)

    def reset(self) -> None:
        self._candidates.clear()
        self._generation = RadixGeneration(self)  # handles from before the reset are rejected
        self._root = RadixNode(self._generation, None, b"", b"", 0)
        self._clock = 0
        self._evictable = 0
        self._protected = 0

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(evictable_size=self._evictable, protected_size=self._protected)

    def check_integrity(self) -> None:
        check_radix_tree(self)

    def _descend(self, ids: bytes) -> tuple[RadixNode, int]:
        """Follow ``ids`` down from the root; split the last edge if the match ends inside it.

        Returns the node whose path is the longest cached page-aligned prefix of ``ids`` and the
        length of that prefix in bytes.
        """
        node = self._root
        position = 0
        page_bytes = self._page_bytes
        end = len(ids)
        while position < end:
            child = node.children.get(ids[position : position + page_bytes])
            if child is None:
                break
            key = child.key
            if ids.startswith(key, position):
                position += len(key)
                node = child
                continue
            common = shared_page_bytes(key, ids, position, self.page_size)
            return self._split(child, common), position + common
        return node, position

    def _split(self, child: RadixNode, at_bytes: int) -> RadixNode:
        """Cut ``child`` after ``at_bytes``; the new upper node takes its place and is returned.

        ``child`` keeps the tail, its candidate entry and every handle that points at it; the
        upper node copies its lock count and recency, so sizes and LRU order are unchanged.
        """
        page_bytes = self._page_bytes
        parent = child.parent
        upper_len = child.cached_len - (len(child.key) - at_bytes) // BYTES_PER_TOKEN
        upper = RadixNode(
            child.generation, parent, child.key[:at_bytes], child.value[:at_bytes], upper_len, child.last_access
        )
        upper.lock_ref = child.lock_ref
        parent.children[child.key[:page_bytes]] = upper
        child.key = child.key[at_bytes:]
        child.value = child.value[at_bytes:]
        child.parent = upper
        upper.children[child.key[:page_bytes]] = child
        return upper

    def _touch_path(self, node: RadixNode) -> None:
        """Give every node from ``node`` up to the root the next clock tick (LRU refresh)."""
        self._clock += 1
        tick = self._clock
        root = self._root
        walker = node
        while walker is not root:
            walker.last_access = tick
            walker = walker.parent
        if node is not root and node.lock_ref == 0 and not node.children:
            self._candidates.add(node)  # re-rank the leaf under its new tick

    def _live_node(self, handle: BaseCacheHandle) -> RadixNode:
        if not isinstance(handle, RadixNode) or handle.generation.cache is not self:
            raise InvalidArgumentError(f"expected a handle from this radix cache, got {handle!r}")
        if handle.generation is not self._generation:
            raise stale_handle_error("was dropped by reset()")
        if handle.parent is None and handle is not self._root:
            raise stale_handle_error("was evicted")
        return handle

    def _path_indices(self, handle: RadixNode) -> torch.Tensor:
        node = self._live_node(handle)
        if node is self._root:
            return self._empty
        values = []
        root = self._root
        while node is not root:
            values.append(node.value)
            node = node.parent
        values.reverse()
        return locations_tensor(values, self.device)
