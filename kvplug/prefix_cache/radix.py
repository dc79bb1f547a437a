"""``radix``: a radix tree over page-aligned token ids, with LRU eviction of unlocked leaves.

Layout. The tree lives on the host whatever the cache's device: token ids and locations are int32
``bytes`` (see ``radix_keys``). Children are keyed by the bytes of their first page, so descending
one edge is one dict lookup plus one memcmp over the whole edge; only a mismatch inside an edge
touches numpy to find where it is. A dense int32 CPU tensor from the caller is read in place (only
the pages a new node keeps are copied); anything else (a device tensor, a strided view) is first
copied to a dense host tensor, which synchronises with an accelerator. Locations are copied to
the cache's device on the way out (``get_matched_indices`` and ``evict``).

Recency. A logical clock ticks once per ``match_prefix``/``insert_prefix``; every node on the
path gets the new tick, so a parent is never older than its children and evicting leaves in
clock order is LRU at every depth. Locks count handles per node along the path to the root.

KV events (``add_kv_event_listener``): a new leaf is a ``BlockStored`` of its pages, an evicted leaf
a ``BlockRemoved``, ``reset`` an ``AllCleared``; splits change no page, so they report nothing. The
page hashes are computed only while someone listens, and kept on the node for its removal.

Eviction candidates (unlocked leaves) are kept incrementally in ``EvictionCandidates``: lock,
unlock, insert, split, match and evict each update O(1) of them; ``evict`` never scans the tree.
"""

from __future__ import annotations

import torch

from kvplug.interface import (
    AllCleared,
    BaseCacheHandle,
    BlockRemoved,
    BlockStored,
    BasePrefixCache,
    InsertResult,
    InvalidArgumentError,
    MatchResult,
    PrefixCacheConfig,
    SizeInfo,
)
from kvplug.prefix_cache.block_hashes import chained_page_hashes
from kvplug.prefix_cache.radix_arguments import checked_host_insert_tokens, checked_host_tokens
from kvplug.prefix_cache.radix_candidates import EvictionCandidates
from kvplug.prefix_cache.radix_integrity import check_radix_tree
from kvplug.prefix_cache.radix_keys import (
    ADDRESS_SPACE,
    ADDRESS_VIEW,
    BYTES_PER_TOKEN,
    as_int32,
    dense_host_nbytes,
    dense_host_pair_nbytes,
    locations_tensor,
    shared_page_bytes,
    tensor_bytes,
)
from kvplug.prefix_cache.radix_node import RadixGeneration, RadixNode, stale_handle_error
from kvplug.prefix_cache.validation import (
    check_location_values,
    checked_evict_size,
    reject_foreign_handle,
    reject_unlock_flag,
)

_new_tuple = tuple.__new__  # builds the NamedTuple results without their Python-level __new__


class RadixPrefixCache(BasePrefixCache):
    """Radix-tree prefix cache (docs/design.md, section 4).

    Handles are the tree's nodes (``RadixNode``). Locks are counted per node, as in SGLang, and
    each node also counts the locks taken on its own handle: an unlock is rejected unless that
    handle (the node ending at the same length) holds one, so unlocking a never-locked prefix of a
    locked handle is refused instead of leaving the longer handle's nodes under-counted.

    Option ``split_refreshes_tail`` (bool, default False): when a match or insert ends inside an
    edge, also give the edge's unused tail the new recency tick. Off, eviction is strict LRU (the
    tail keeps its age); on, the eviction order is SGLang's RadixCache's, which stamps an edge
    before comparing it (the SGLang host turns it on for exact parity).
    """

    publishes_kv_events = True
    trusted = True  # built in: a KVBackend uses its answers unchecked (the tiered subclass too)

    def __init__(self, config: PrefixCacheConfig) -> None:
        options = dict(config.options)
        self._split_refreshes_tail = options.pop("split_refreshes_tail", False)
        if options or not isinstance(self._split_refreshes_tail, bool):
            raise InvalidArgumentError(
                "the radix prefix cache takes only the option split_refreshes_tail (a bool), "
                f"got {dict(config.options)}"
            )
        self.device = config.device  # PrefixCacheConfig names the CUDA index
        self.page_size = config.page_size
        self._on_cpu = self.device.type == "cpu"
        self._page_bytes = config.page_size * BYTES_PER_TOKEN
        self._empty = torch.empty(0, dtype=torch.int32, device=self.device)
        self._candidates = EvictionCandidates()
        self.reset()

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        end = dense_host_nbytes(input_ids) if self._on_cpu else -1
        if end >= 0:
            tokens = input_ids
        else:
            tokens = checked_host_tokens(input_ids, self.device, self.page_size)
            end = tokens.nbytes
        node, _ = self._descend(tokens.data_ptr(), end - end % self._page_bytes)
        self._touch_path(node)
        return _new_tuple(MatchResult, (node,))

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        if unlock.__class__ is not bool:
            reject_unlock_flag(unlock)
        root = self._root
        node = handle
        # Fast path: a live non-root node of this tree (the root and evicted nodes have no parent).
        if type(node) is not RadixNode or node.generation is not self._generation or node.parent is None:
            node = self._live_node(handle)
            if node is root:
                return
        step, flips_at = self._count_own_lock(node, handle, unlock)
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

    @staticmethod
    def _count_own_lock(node: RadixNode, handle: BaseCacheHandle, unlock: bool) -> tuple[int, int]:
        """Take or release ``handle``'s own lock on ``node``; returns ``(step, flips_at)``: what
        every node up to the root adds to ``lock_ref``, and the ``lock_ref`` at which a node flips
        between evictable and protected. Raises (nothing changed) for an unlock without a lock."""
        if unlock:
            if node.own_locks <= 0:
                # a lock on a longer prefix covers this node too, but it is that handle's to release
                raise InvalidArgumentError(
                    f"cannot unlock {handle!r}: it holds no lock of its own "
                    f"({node.lock_ref - node.own_locks} lock(s) on longer prefixes cover it)"
                    if node.lock_ref
                    else f"cannot unlock {handle!r}: it is not locked"
                )
            node.own_locks -= 1
            return -1, 1
        node.own_locks += 1
        return 1, 0

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        end = dense_host_pair_nbytes(input_ids, indices) if self._on_cpu else -1
        if end >= 0 and not end % self._page_bytes:
            tokens = input_ids
            locations_at = indices.data_ptr()
            check_location_values(as_int32(ADDRESS_VIEW[locations_at : locations_at + end]))
        else:
            tokens = checked_host_insert_tokens(input_ids, indices, self.device, self.page_size)
            end = tokens.nbytes
            locations_at = -1  # read through tensor_bytes
        tokens_at = tokens.data_ptr()
        node, matched_bytes = self._descend(tokens_at, end)
        if matched_bytes < end:
            if locations_at >= 0:
                locations = ADDRESS_SPACE[locations_at + matched_bytes : locations_at + end]
            else:
                locations = tensor_bytes(indices, matched_bytes // BYTES_PER_TOKEN, end // BYTES_PER_TOKEN)
            key = ADDRESS_SPACE[tokens_at + matched_bytes : tokens_at + end]
            self._clock += 1  # the touch of the new path: the leaf is born with the new tick
            leaf = RadixNode(self._generation, node, key, locations, end // BYTES_PER_TOKEN, self._clock)
            node.children[key[: self._page_bytes]] = leaf
            if node.heap_seq >= 0:
                self._candidates.discard(node)  # it stops being a leaf
            self._evictable += (end - matched_bytes) // BYTES_PER_TOKEN
            self._candidates.add(leaf)
            self._stamp_ancestors(node, self._clock)
            if self.__dict__.get("_kv_event_listeners"):
                self._report_stored(leaf)
            return _new_tuple(InsertResult, (matched_bytes // BYTES_PER_TOKEN, leaf))
        self._touch_path(node)
        return _new_tuple(InsertResult, (matched_bytes // BYTES_PER_TOKEN, node))

    def evict(self, size: int) -> torch.Tensor:
        size = checked_evict_size(size, self._evictable, self._protected)
        if size == 0:
            return self._empty
        freed: list[bytes] = []
        freed_bytes = 0
        wanted_bytes = size * BYTES_PER_TOKEN
        root = self._root
        page_bytes = self._page_bytes
        reporting = bool(self.__dict__.get("_kv_event_listeners"))
        while freed_bytes < wanted_bytes:
            leaf = self._candidates.pop_least_recent()
            if reporting:
                self.emit_kv_event(BlockRemoved(self._page_hashes(leaf)))
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
        if self.__dict__.get("_kv_event_listeners"):
            self.emit_kv_event(AllCleared())

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(evictable_size=self._evictable, protected_size=self._protected)

    def check_integrity(self) -> None:
        check_radix_tree(self)

    def _descend(self, tokens_at: int, end: int) -> tuple[RadixNode, int]:
        """Follow the token ids at ``[tokens_at, tokens_at + end)`` (host memory, ``end`` a whole
        number of pages in bytes) down from the root; split the last edge if the match ends inside it.

        Returns the node whose path is the longest cached page-aligned prefix of the ids and the
        length of that prefix in bytes. The ids are read in place: one small copy per edge for the
        child lookup, and a zero-copy view compared with one memcmp per edge.
        """
        node = self._root
        page_bytes = self._page_bytes
        here = tokens_at  # address of the first token not matched yet
        stop = tokens_at + end
        while here < stop:
            child = node.children.get(ADDRESS_SPACE[here : here + page_bytes])
            if child is None:
                break
            key = child.key
            after = here + len(key)
            if after <= stop and key.startswith(ADDRESS_VIEW[here:after]):
                here = after
                node = child
                continue
            common = shared_page_bytes(key, ADDRESS_VIEW[here:stop], self.page_size)
            return self._split(child, common), here - tokens_at + common
        return node, here - tokens_at

    def _split(self, child: RadixNode, at_bytes: int) -> RadixNode:
        """Cut ``child`` after ``at_bytes``; the new upper node takes its place and is returned.

        ``child`` keeps the tail, its candidate entry and every handle that points at it; the
        upper node copies its lock count and recency, so sizes and LRU order are unchanged (with
        ``split_refreshes_tail`` the tail also takes the tick the caller's ``_touch_path`` is about to give).
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
        if child.page_hashes is not None:  # a page's hash depends only on its path: split them as is
            upper_pages = at_bytes // page_bytes
            upper.page_hashes, child.page_hashes = child.page_hashes[:upper_pages], child.page_hashes[upper_pages:]
        if self._split_refreshes_tail:
            child.last_access = self._clock + 1  # the tick _touch_path gives the path right after
            if child.heap_seq >= 0:
                self._candidates.add(child)  # re-rank under the new tick
        return upper

    def _touch_path(self, node: RadixNode) -> None:
        """Give every node from ``node`` up to the root the next clock tick (LRU refresh)."""
        self._clock += 1
        self._stamp_ancestors(node, self._clock)
        if node is not self._root and node.lock_ref == 0 and not node.children:
            self._candidates.add(node)  # re-rank the leaf under its new tick

    def _stamp_ancestors(self, node: RadixNode, tick: int) -> None:
        """Set ``last_access = tick`` from ``node`` up to (not including) the root."""
        root = self._root
        while node is not root:
            node.last_access = tick
            node = node.parent

    def _report_stored(self, leaf: RadixNode) -> None:
        """``BlockStored`` for the pages of a new leaf."""
        parent = leaf.parent
        parent_hash = self._page_hashes(parent)[-1] if parent is not self._root else None
        self.emit_kv_event(
            BlockStored(
                self._page_hashes(leaf),
                parent_hash,
                tuple(as_int32(leaf.key).tolist()),
                self.page_size,
            )
        )

    def _page_hashes(self, node: RadixNode) -> tuple[int, ...]:
        """The KV-event hashes of ``node``'s pages (computed on first use, ancestors first)."""
        if node.page_hashes is None:
            parent = node.parent
            parent_hash = self._page_hashes(parent)[-1] if parent is not self._root else None
            node.page_hashes = chained_page_hashes(node.key, self.page_size, parent_hash)
        return node.page_hashes

    def _live_node(self, handle: BaseCacheHandle) -> RadixNode:
        if not isinstance(handle, RadixNode) or handle.generation.cache is not self:
            reject_foreign_handle("radix", handle)
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
