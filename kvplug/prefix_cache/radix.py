"""``radix``: a radix tree over page-aligned token ids, with LRU eviction of unlocked leaves.

Layout. The tree lives on the host whatever the cache's device: token ids and locations are int32
``bytes`` (``radix_keys``), read from the caller's tensors through numpy (``radix_arguments``).
Children are keyed by the bytes of their first page, so descending one edge is one dict lookup
plus one memcmp over the whole edge; only a mismatch inside an edge touches numpy to find where.

Validation costs O(new pages): the locations of the part an insert adds are checked (distinct,
non-negative); the already-cached prefix is neither re-read nor re-validated. kvplug's allocator
calls the host-array methods (``HostArrayCalls``: numpy in, bare handles and arrays out, the
locations its own pages, so checked once, by the allocator's ownership, not again here). The tree is only
changed once every check passed (a match ending inside an edge is split after validation).

Recency. A logical clock ticks once per ``match_prefix``/``insert_prefix``; every node on the
path gets the new tick, so a parent is never older than its children and evicting leaves in
clock order is LRU at every depth. Locks count handles per node along the path to the root.

Eviction candidates (``EvictionCandidates``) are kept incrementally: lock, unlock, insert, split,
match and evict each update O(1) of them; ``evict`` never scans the tree.

Tiers. A node is device-resident (``value``: KV-pool locations) or, with a host tier, host-resident;
below a host-resident node everything is host-resident. The tree keeps both tiers' sizes and
candidates (device: unlocked device nodes whose children are all host-resident, which without a
tier are the unlocked leaves; host: unlocked host-resident leaves) and calls its ``TierPolicy``
(``radix_tier``) where bytes must move. Without a tier no node is ever host-resident.

KV events (``add_kv_event_listener``): a new leaf is a ``BlockStored`` of its pages, an evicted leaf
a ``BlockRemoved``, ``reset`` an ``AllCleared``; splits change no page, so they report nothing. The
page hashes are computed only while someone listens, and kept on the node for its removal.
"""

from __future__ import annotations

import numpy as np
import torch

from kvplug.interface import (
    KV_MEDIUM_DEVICE,
    KV_MEDIUM_HOST,
    AllCleared,
    BaseCacheHandle,
    BasePrefixCache,
    BlockRemoved,
    BlockStored,
    InsertResult,
    InvalidArgumentError,
    MatchResult,
    PrefixCacheConfig,
    SizeInfo,
)
from kvplug.prefix_cache.block_hashes import chained_page_hashes
from kvplug.prefix_cache.host_arrays import HOST_INT32, HostArrayCalls, is_host_int32, reject_host_array
from kvplug.prefix_cache.radix_arguments import (
    dense_host_array,
    dense_host_pair,
    insert_arguments,
    match_tokens,
)
from kvplug.prefix_cache.radix_candidates import EvictionCandidates
from kvplug.prefix_cache.radix_keys import (
    BYTES_PER_TOKEN,
    as_int32,
    locations_tensor,
    shared_page_bytes,
)
from kvplug.prefix_cache.radix_node import (
    RadixGeneration,
    RadixNode,
    stale_handle_error,
)
from kvplug.prefix_cache.radix_tier import TierPolicy
from kvplug.prefix_cache.validation import (
    check_location_values,
    checked_evict_size,
    reject_foreign_handle,
    reject_unlock_flag,
)

_new_node = object.__new__  # a new leaf without RadixNode.__init__'s call (see _insert)
_new_tuple = tuple.__new__  # builds the NamedTuple results without their Python-level __new__
_NDARRAY = np.ndarray
_NO_LOCATIONS = as_int32(b"")
assert BYTES_PER_TOKEN == 4  # the hot paths turn bytes into tokens with ``>> 2``


class RadixPrefixCache(BasePrefixCache, HostArrayCalls):
    """Radix-tree prefix cache (docs/design.md, section 4).

    Handles are the tree's nodes (``RadixNode``). Locks are counted per node, as in SGLang, and
    each node also counts the locks taken on its own handle: an unlock is rejected unless that
    handle (the node ending at the same length) holds one, so unlocking a never-locked prefix of a
    locked handle is refused instead of leaving the longer handle's nodes under-counted.

    Option ``split_refreshes_tail`` (bool, default False): when a match or insert ends inside an
    edge, also give the edge's unused tail the new recency tick. Off, eviction is strict LRU (the
    tail keeps its age); on, the eviction order is SGLang's RadixCache's, which stamps an edge
    before comparing it (the SGLang host turns it on for exact parity).

    Args:
        config: the factory's config (``device``, ``page_size``, ``options``).
        tier: the policy of a second tier (``TieredRadixPrefixCache`` passes its host tier), or None.
    """

    publishes_kv_events = True
    trusted = True  # built in: a KVBackend uses its answers unchecked (the tiered subclass too)

    def __init__(self, config: PrefixCacheConfig, *, tier: TierPolicy | None = None) -> None:
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
        self._tier = tier
        self._candidates = EvictionCandidates()
        self._host_candidates = EvictionCandidates("host_heap_seq", "host-resident leaves")
        # BasePrefixCache's listener list (add_kv_event_listener appends to it), made up front so the
        # hot paths read a plain attribute rather than self.__dict__.get(...)
        self._kv_event_listeners: list = []
        self.reset()

    # ------------------------------------------------------------------ version-1 surface
    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        node = self._match(input_ids)
        if node.on_host:
            node = self.device_head(node)
        return _new_tuple(MatchResult, (node,))

    def match_host(self, input_ids: np.ndarray) -> RadixNode:
        if input_ids.__class__ is not _NDARRAY or input_ids.dtype is not HOST_INT32 or input_ids.ndim != 1:
            if not is_host_int32(input_ids):
                reject_host_array(input_ids, "input_ids")
        length = len(input_ids)  # 1-D: len() is shape[0] without building the shape tuple
        if length % self.page_size:
            input_ids = input_ids[: length - length % self.page_size]
        node = self._match_tokens(input_ids.tobytes())
        return self.device_head(node) if node.on_host else node

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        if unlock.__class__ is not bool:
            reject_unlock_flag(unlock)
        root = self._root
        node = handle
        # Fast path: a live non-root node of this tree (the root and evicted nodes have no parent).
        if type(node) is not RadixNode or node.generation is not self._generation or node.parent is None:
            node = self.live_node(handle)
            if node is root:
                return
        if unlock:
            step, flips_at = self._count_own_lock(node, handle, unlock)
        else:  # _count_own_lock, inline
            node.own_locks += 1
            step = 1
            flips_at = 0
        moved = moved_host = 0  # bytes of locations whose node flips between evictable and protected
        walker = node
        while walker is not root:
            if walker.lock_ref == flips_at:
                if walker.on_host:
                    moved_host += len(walker.value)
                else:
                    moved += len(walker.value)
            walker.lock_ref += step
            walker = walker.parent
        if moved:
            moved = moved >> 2 if unlock is False else -(moved >> 2)
            self._evictable -= moved
            self._protected += moved
        if moved_host:
            moved_host = step * (moved_host // BYTES_PER_TOKEN)
            self._host_evictable -= moved_host
            self._host_protected += moved_host
        if node.on_host:
            self.refresh(node)
            self.refresh(self.device_head(node))
        elif node.lock_ref:  # inline refresh(): a locked device node is no candidate
            if node.heap_seq >= 0:
                self._candidates.discard(node)
        else:
            self.refresh(node)

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
        # the common case, read in place: dense int32 CPU tensors of equal length, whole pages
        arrays = dense_host_pair(input_ids, indices) if self._on_cpu else None
        if arrays is None or arrays[0].shape[0] % self.page_size:
            tokens, locations = insert_arguments(input_ids, indices, self.device, self.page_size)
        else:
            tokens = arrays[0].tobytes()
            locations = arrays[1]
        return _new_tuple(InsertResult, self._insert(tokens, locations, True))

    def insert_host(self, input_ids: np.ndarray, indices: np.ndarray) -> tuple[int, RadixNode]:
        if (
            input_ids.__class__ is not _NDARRAY or indices.__class__ is not _NDARRAY
            or input_ids.dtype is not HOST_INT32 or indices.dtype is not HOST_INT32
            or input_ids.ndim != 1 or indices.ndim != 1
        ):
            self._check_host_insert(input_ids, indices)
        length = len(input_ids)  # 1-D: len() is shape[0] without building the shape tuple
        if length != len(indices) or length % self.page_size:
            self._check_host_insert(input_ids, indices)
        return self._insert(input_ids.tobytes(), indices, False)

    def _check_host_insert(self, input_ids: object, indices: object) -> None:
        """Raise unless ``insert_host``'s arguments are int32 host arrays of one length, whole pages."""
        if not is_host_int32(input_ids):
            reject_host_array(input_ids, "input_ids")
        if not is_host_int32(indices):
            reject_host_array(indices, "indices")
        if input_ids.shape[0] != indices.shape[0]:
            raise InvalidArgumentError(
                f"input_ids and indices must have the same length, got {input_ids.shape[0]} and {indices.shape[0]}"
            )
        if input_ids.shape[0] % self.page_size:
            raise InvalidArgumentError(
                f"inserted length must be a multiple of the page size {self.page_size}, got {input_ids.shape[0]}"
            )

    def _insert(self, tokens: bytes, locations: np.ndarray, check: bool) -> tuple[int, RadixNode]:
        """Insert ``tokens`` (int32 bytes, whole pages) with ``locations`` (host int32 array of as
        many tokens, any strides); returns ``(cached_len, handle)``. ``check``: validate the
        locations of the new part (``insert_host``'s caller owns them: see ``HostArrayCalls``)."""
        if self._tier is not None:
            return self._insert_tiered(tokens, locations, check)
        node = self._root
        page_bytes = self._page_bytes
        matched = 0  # bytes
        end = len(tokens)
        while matched < end:  # _find, inline
            first_page = tokens[matched : matched + page_bytes]
            child = node.children.get(first_page)
            if child is None:
                break  # first_page: the new leaf's
            key = child.key
            if tokens.startswith(key, matched):  # False as well when the tokens end inside the edge
                matched += len(key)
                node = child
                continue
            return self._insert_into_edge(child, tokens, matched, locations, check)  # rare: out of line
        else:  # all cached already
            self._touch_path(node)
            return end >> 2, node
        if check:
            check_location_values(locations[matched >> 2 :])  # the new part only: O(new pages)
        value = locations[matched >> 2 :].tobytes()
        return matched >> 2, self._new_leaf(node, first_page, tokens[matched:], value, end >> 2)

    def _insert_into_edge(
        self, child: RadixNode, tokens: bytes, matched: int, locations: np.ndarray, check: bool
    ) -> tuple[int, RadixNode]:
        """``_insert`` whose tokens leave the tree inside the edge of ``child`` (after ``matched``
        bytes down to its parent): split the edge where they part, then add the rest below."""
        end = len(tokens)
        common = shared_page_bytes(child.key, tokens, matched, self.page_size)
        matched += common
        if matched == end:  # all cached already: the tokens end inside the edge
            node = self._split(child, common)
            self._touch_path(node)
            return end >> 2, node
        if check:
            check_location_values(locations[matched >> 2 :])  # the new part only: O(new pages)
        node = self._split(child, common)
        first_page = tokens[matched : matched + self._page_bytes]
        value = locations[matched >> 2 :].tobytes()
        return matched >> 2, self._new_leaf(node, first_page, tokens[matched:], value, end >> 2)

    def _new_leaf(self, node: RadixNode, first_page: bytes, key: bytes, value: bytes, cached_len: int) -> RadixNode:
        """Hang a new device-resident leaf (``key``, starting with ``first_page``; ``value``) below
        ``node``, a device-resident node, and give the new path the next clock tick."""
        self._clock = tick = self._clock + 1  # the leaf is born with the new tick
        # NOTE: RadixNode.__init__ inline (its call is ~3% of an insert); every slot must be set here too
        # (test_radix_cache's test_inserted_leaf_sets_every_slot compares the two)
        leaf = _new_node(RadixNode)
        leaf.cached_len = cached_len
        leaf.parent = node
        leaf.children = {}
        leaf.key = key
        leaf.first_page = first_page
        leaf.value = value
        leaf.lock_ref = 0
        leaf.own_locks = 0
        leaf.last_access = tick
        leaf.heap_seq = -1  # add_newest numbers it
        leaf.generation = self._generation
        leaf.page_hashes = None
        leaf.on_host = False
        leaf.host_children = 0
        leaf.host_heap_seq = -1
        leaf.host_copy = None
        node.children[first_page] = leaf
        candidates = self._candidates
        if node.heap_seq >= 0:
            candidates.discard(node)  # it has a device-resident child now
        candidates.add_newest(leaf)
        self._evictable += len(value) >> 2
        root = self._root
        while node is not root:  # the new tick up to the root
            node.last_access = tick
            node = node.parent
        if self._kv_event_listeners:
            self.report_stored(leaf)
        return leaf

    def _insert_tiered(self, tokens: bytes, locations: np.ndarray, check: bool) -> tuple[int, RadixNode]:
        """``_insert`` when a host tier may hold part of the path."""
        end = len(tokens)
        node, here, common, partial = self._find(tokens)
        matched = here + common
        # the path's device-resident head is what the caller's copy duplicates; the rest it gives us
        on_host = (partial if partial is not None else node).on_host
        head = self.device_head(node) if on_host else None
        kept_from = head.cached_len * BYTES_PER_TOKEN if on_host else matched
        if check and kept_from < end:
            check_location_values(locations[kept_from // BYTES_PER_TOKEN :])  # the new part only: O(new pages)
        if partial is not None:
            node = self._split(partial, common)
        if on_host:
            self._tier.adopt(node, head, locations[kept_from // BYTES_PER_TOKEN : matched // BYTES_PER_TOKEN].tobytes())
        cached_len = kept_from // BYTES_PER_TOKEN
        if matched == end:
            self._touch_path(node)
            return cached_len, node
        first_page = tokens[matched : matched + self._page_bytes]
        value = locations[matched // BYTES_PER_TOKEN :].tobytes()
        return cached_len, self._new_leaf(node, first_page, tokens[matched:], value, end // BYTES_PER_TOKEN)

    def evict(self, size: int) -> torch.Tensor:
        freed = self._evict(size)
        return locations_tensor(freed, self.device) if freed else self._empty

    def evict_host(self, size: int) -> np.ndarray:
        freed = self._evict(size)
        return as_int32(b"".join(freed)) if freed else _NO_LOCATIONS

    def _evict(self, size: int) -> list[bytes]:
        """Evict at least ``size`` tokens, least recently used leaves first; their values."""
        if size.__class__ is not int or not 0 < size <= self._evictable:  # the common case: one test
            size = checked_evict_size(size, self._evictable, self._protected)
            if size == 0:
                return []
        if self._tier is None and not self._kv_event_listeners:
            return self._evict_leaves(size << 2)
        freed: list[bytes] = []
        freed_bytes = 0
        wanted_bytes = size * BYTES_PER_TOKEN
        tier = self._tier
        write_backs = tier.begin_evict() if tier is not None else None
        try:
            while freed_bytes < wanted_bytes:
                leaf = self._candidates.pop_least_recent()
                value = leaf.value
                freed.append(value)
                freed_bytes += len(value)
                self._evictable -= len(value) // BYTES_PER_TOKEN
                parent = leaf.parent
                if tier is None or not tier.keep_evicted(leaf, write_backs):
                    self.drop_subtree(leaf)
                self.refresh(parent)  # it may have become a candidate
        finally:  # the leaves moved so far are host-resident: their copies are issued whatever happened
            if tier is not None:
                tier.finish_evict(write_backs)
        return freed

    def _evict_leaves(self, wanted_bytes: int) -> list[bytes]:
        """``_evict`` without a tier or listeners: every candidate is an unlocked leaf, so evicting
        one only unlinks it, and its parent becomes a candidate once it is an unlocked leaf."""
        freed: list[bytes] = []
        freed_bytes = 0
        root = self._root
        candidates = self._candidates
        pop, add_new = candidates.pop_least_recent, candidates.add_new
        while freed_bytes < wanted_bytes:
            leaf = pop()
            value = leaf.value
            freed.append(value)
            freed_bytes += len(value)
            parent = leaf.parent
            del parent.children[leaf.first_page]  # its own key object: no slice, no hash
            leaf.parent = None
            if not parent.children and not parent.lock_ref and parent is not root:
                add_new(parent)  # an internal node is never a candidate: this one is new
        self._evictable -= freed_bytes >> 2
        return freed

    def reset(self) -> None:
        self._candidates.clear()
        self._host_candidates.clear()
        self._generation = RadixGeneration(self)  # handles from before the reset are rejected
        self._root = RadixNode(self._generation, None, b"", b"", 0)
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self._host_evictable = 0
        self._host_protected = 0
        if self._kv_event_listeners:
            self.emit_kv_event(AllCleared())
        if self._tier is not None:
            self._tier.reset()

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(evictable_size=self._evictable, protected_size=self._protected)

    # ------------------------------------------------------------------ the tree
    def _match(self, input_ids: torch.Tensor) -> RadixNode:
        """The deepest node of the longest cached prefix of ``input_ids`` (either tier), touched."""
        ids = dense_host_array(input_ids) if self._on_cpu else None
        if ids is not None and not ids.shape[0] % self.page_size:
            tokens = ids.tobytes()
        else:
            tokens = match_tokens(input_ids, self.device, self.page_size)
        return self._match_tokens(tokens)

    def _match_tokens(self, tokens: bytes) -> RadixNode:
        """The deepest node of the longest cached prefix of ``tokens`` (int32 bytes, whole pages),
        split there if it ends inside an edge, and touched (``_find``, ``_split``, ``_touch_path``)."""
        node = root = self._root
        page_bytes = self._page_bytes
        here = 0
        stop = len(tokens)
        while here < stop:  # _find, inline
            child = node.children.get(tokens[here : here + page_bytes])
            if child is None:
                break
            key = child.key
            if tokens.startswith(key, here):  # False as well when the tokens end inside the edge
                here += len(key)
                node = child
                continue
            node = self._split(child, shared_page_bytes(key, tokens, here, self.page_size))
            break
        if node.on_host or node.lock_ref == 0 and node.host_children == len(node.children):
            self._touch_path(node)  # a candidate to re-rank (or the root: nothing to rank)
            return node
        self._clock = tick = self._clock + 1  # _touch_path of a node that is no candidate, inline
        walker = node
        while walker is not root:  # the new tick up to the root
            walker.last_access = tick
            walker = walker.parent
        return node

    def _find(self, tokens: bytes) -> tuple[RadixNode, int, int, RadixNode | None]:
        """Follow ``tokens`` (int32 bytes, whole pages) down from the root; changes nothing.

        Returns ``(node, here, common, partial)``: ``node`` is the deepest node whose whole path
        the tokens start with, ``here`` that path's length in bytes; when the match goes on for
        ``common`` bytes (whole pages) into the edge of ``partial``, a child of ``node``, the caller
        splits it there (``_split``); else ``partial`` is None and ``common`` 0.
        """
        node = self._root
        page_bytes = self._page_bytes
        here = 0  # bytes matched so far
        stop = len(tokens)
        while here < stop:
            child = node.children.get(tokens[here : here + page_bytes])
            if child is None:
                break
            key = child.key
            after = here + len(key)
            if after <= stop and tokens.startswith(key, here):
                here = after
                node = child
                continue
            return node, here, shared_page_bytes(key, tokens, here, self.page_size), child
        return node, here, 0, None

    def _split(self, child: RadixNode, at_bytes: int) -> RadixNode:
        """Cut ``child`` after ``at_bytes``; the new upper node takes its place and is returned.

        ``child`` keeps the tail, its candidate entry and every handle that points at it; the
        upper node copies its lock count, tier and recency, so sizes and LRU order are unchanged (with
        ``split_refreshes_tail`` the tail also takes the tick the caller's ``_touch_path`` is about to give).
        """
        page_bytes = self._page_bytes
        parent = child.parent
        upper_len = child.cached_len - (len(child.key) - at_bytes) // BYTES_PER_TOKEN
        upper = RadixNode(
            child.generation, parent, child.key[:at_bytes], child.value[:at_bytes], upper_len, child.last_access,
            child.first_page,
        )
        upper.lock_ref = child.lock_ref
        if child.on_host:
            upper.on_host = True
            upper.host_children = 1
        parent.children[upper.first_page] = upper  # in child's place, under the same key object
        child.key = child.key[at_bytes:]
        child.first_page = first_page = child.key[:page_bytes]
        child.value = child.value[at_bytes:]
        child.parent = upper
        upper.children[first_page] = child
        if child.page_hashes is not None:  # a page's hash depends only on its path: split them as is
            upper_pages = at_bytes // page_bytes
            upper.page_hashes, child.page_hashes = child.page_hashes[:upper_pages], child.page_hashes[upper_pages:]
        if self._tier is not None:
            self._tier.on_split(upper, child, at_bytes)
        if self._split_refreshes_tail:
            child.last_access = self._clock + 1  # the tick _touch_path gives the path right after
            if child.heap_seq >= 0:
                self._candidates.add(child)  # re-rank under the new tick
            if child.host_heap_seq >= 0:
                self._host_candidates.add(child)
        return upper

    def _touch_path(self, node: RadixNode) -> None:
        """Give every node from ``node`` up to the root the next clock tick (LRU refresh)."""
        self._clock = tick = self._clock + 1
        root = self._root
        walker = node
        while walker is not root:  # the new tick up to the root
            walker.last_access = tick
            walker = walker.parent
        if node.on_host:
            self.refresh(node)
            self.refresh(self.device_head(node))
        elif node.lock_ref == 0 and node.host_children == len(node.children) and node.parent is not None:
            self._candidates.add(node)  # re-rank it under its new tick (refresh(), inline)
        elif node.heap_seq >= 0:
            self._candidates.discard(node)

    # ------------------------------------------------------------------ what the tier calls
    def refresh(self, node: RadixNode) -> None:
        """Put ``node`` in (or out of) its tier's eviction candidates, ranked by its recency.

        Device candidates: unlocked device-resident nodes whose children are all host-resident
        (without a tier: the unlocked leaves). Host candidates: unlocked host-resident leaves.
        """
        if node.parent is None:  # the root, or a node no longer in the tree
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
        if node.lock_ref == 0 and node.host_children == len(node.children):
            self._candidates.add(node)
        elif node.heap_seq >= 0:
            self._candidates.discard(node)

    def device_head(self, node: RadixNode) -> RadixNode:
        """The deepest device-resident node on ``node``'s path (``node`` itself, or the root)."""
        while node.on_host:
            node = node.parent
        return node

    def set_host_resident(self, node: RadixNode, host_value: bytes) -> None:
        """``node`` (device-resident, unlocked, already off the device tier's books: ``evict`` took
        it) now holds host locations ``host_value`` (int32 bytes, as long as its value)."""
        node.value = host_value
        node.on_host = True
        node.parent.host_children += 1
        self._host_evictable += len(host_value) // BYTES_PER_TOKEN
        self.refresh(node)

    def set_device_resident(self, node: RadixNode, device_value: bytes) -> None:
        """Host-resident ``node`` (its parent device-resident) now holds device locations
        ``device_value`` (int32 bytes); the caller refreshes the candidates of the moved path."""
        node.value = device_value
        node.on_host = False
        node.parent.host_children -= 1
        tokens = len(device_value) // BYTES_PER_TOKEN
        if node.lock_ref:
            self._host_protected -= tokens
            self._protected += tokens
        else:
            self._host_evictable -= tokens
            self._evictable += tokens
        if self._kv_event_listeners:
            self.report_stored(node)

    def add_host_leaf(self, node: RadixNode, key: bytes, host_value: bytes, cached_len: int) -> RadixNode:
        """Hang a new host-resident leaf below ``node`` (no child of ``node`` starts with ``key``'s
        first page) at host locations ``host_value``, and touch its path: pages the host tier got
        from elsewhere (a shared KV store) than an eviction."""
        first_page = key[: self._page_bytes]
        leaf = RadixNode(self._generation, node, key, host_value, cached_len, first_page=first_page)
        leaf.on_host = True
        node.children[first_page] = leaf
        node.host_children += 1
        self._host_evictable += len(host_value) // BYTES_PER_TOKEN
        self.refresh(node)  # a host leaf no more, or a device node with one more host child
        self._touch_path(leaf)
        if self._kv_event_listeners:
            self.report_stored(leaf)
        return leaf

    def pop_host_candidate(self) -> RadixNode | None:
        """The least recently used unlocked host-resident leaf, out of the candidates; None if none."""
        return self._host_candidates.pop_least_recent() if len(self._host_candidates) else None

    def drop_subtree(self, node: RadixNode) -> RadixNode:
        """Remove unlocked ``node`` and everything below it (all host-resident) from the tree and
        return its parent. A device-resident ``node`` is already off the device tier's books
        (``evict`` took it); host-resident nodes are taken off the host tier's here."""
        parent = node.parent
        del parent.children[node.first_page]
        if node.on_host:
            parent.host_children -= 1
        tier = self._tier
        reporting = bool(self._kv_event_listeners)
        stack = [node]
        while stack:
            dropping = stack.pop()
            if dropping.children:
                stack.extend(dropping.children.values())
            if dropping.on_host:
                self._host_evictable -= len(dropping.value) // BYTES_PER_TOKEN
                self._host_candidates.discard(dropping)
            elif dropping.heap_seq >= 0:
                self._candidates.discard(dropping)
            if tier is not None:
                tier.on_drop(dropping)
            if reporting:
                self.emit_kv_event(
                    BlockRemoved(self.page_hashes(dropping), KV_MEDIUM_HOST if dropping.on_host else KV_MEDIUM_DEVICE)
                )
        stack = [node]
        while stack:  # detach after reporting: a child's hashes chain through its parent's
            dropping = stack.pop()
            if dropping.children:
                stack.extend(dropping.children.values())
            dropping.parent = None
        return parent

    def live_node(self, handle: BaseCacheHandle) -> RadixNode:
        """``handle`` if it is a node of this cache's current tree, else ``InvalidArgumentError``."""
        if not isinstance(handle, RadixNode) or handle.generation.cache is not self:
            reject_foreign_handle("radix", handle)
        if handle.generation is not self._generation:
            raise stale_handle_error("was dropped by reset()")
        if handle.parent is None and handle is not self._root:
            raise stale_handle_error("was evicted")
        return handle

    def path_indices(self, handle: RadixNode) -> torch.Tensor:
        """``handle.get_matched_indices()``: shape ``[cached_len]``, int32, on the cache's device."""
        node = self.live_node(handle)
        if node.on_host:
            raise InvalidArgumentError(
                f"the prefix of {handle!r} ends in host memory: load it with load_host_prefix before reading "
                "its locations"
            )
        if node is self._root:
            return self._empty
        values = []
        root = self._root
        while node is not root:
            values.append(node.value)
            node = node.parent
        values.reverse()
        return locations_tensor(values, self.device)

    # ------------------------------------------------------------------ KV events
    def report_stored(self, node: RadixNode) -> None:
        """``BlockStored`` for the pages of ``node``, in the medium of its tier."""
        parent = node.parent
        parent_hash = self.page_hashes(parent)[-1] if parent is not self._root else None
        self.emit_kv_event(
            BlockStored(
                self.page_hashes(node), parent_hash, tuple(as_int32(node.key).tolist()), self.page_size,
                KV_MEDIUM_HOST if node.on_host else KV_MEDIUM_DEVICE,
            )
        )

    def page_hashes(self, node: RadixNode) -> tuple[int, ...]:
        """The KV-event hashes of ``node``'s pages (computed on first use, ancestors first)."""
        if node.page_hashes is None:
            parent = node.parent
            parent_hash = self.page_hashes(parent)[-1] if parent is not self._root else None
            node.page_hashes = chained_page_hashes(node.key, self.page_size, parent_hash)
        return node.page_hashes

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant; one full walk (slow on purpose).

        Checked: root shape; every edge a non-empty page multiple with as many locations as token
        ids; handle lengths and generations; parent/child links and first-page child keys (each node's
        ``first_page`` too); lock counts (never negative; a node counts its own locks plus its
        children's); recency (a parent is never older than a child, nothing newer than the clock);
        below a host-resident node everything is host-resident, and each node counts its
        host-resident children; per tier, the sizes and the eviction candidates; no device location
        held twice; then the tier's own state (``TierPolicy.check_integrity``).
        """
        root = self._root
        assert root.parent is None and root.key == root.first_page == root.value == b"" and not root.on_host, (
            "root must be an empty device edge"
        )
        assert root.lock_ref == 0 and root.heap_seq < 0 and root.host_heap_seq < 0, (
            "the root is never locked nor an eviction candidate"
        )
        assert root.cached_len == 0 and root.generation is self._generation, "the root must start the current tree"
        sizes = {False: [0, 0], True: [0, 0]}  # on_host -> [evictable, protected]
        device_candidates: list[RadixNode] = []
        host_candidates: list[RadixNode] = []
        device_locations: list[bytes] = []
        nodes: list[RadixNode] = []
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = host_children = 0
            for first_page, child in node.children.items():
                self._check_edge(child, node, first_page)
                child_locks += child.lock_ref
                host_children += child.on_host
                stack.append(child)
            assert node.host_children == host_children, (
                f"{node!r} counts {node.host_children} host-resident children, it has {host_children}"
            )
            if node is root:
                continue
            nodes.append(node)
            assert node.own_locks >= 0, f"{node!r}: negative count of its own locks"
            assert node.lock_ref == node.own_locks + child_locks, (
                f"{node!r}: lock_ref {node.lock_ref} != its own locks {node.own_locks} + its children's lock "
                f"counts {child_locks}"
            )
            sizes[node.on_host][1 if node.lock_ref else 0] += node.num_tokens
            if not node.on_host:
                device_locations.append(node.value)
            if node.lock_ref == 0:
                if node.on_host and not node.children:
                    host_candidates.append(node)
                elif not node.on_host and host_children == len(node.children):
                    device_candidates.append(node)
        assert sizes[False] == [self._evictable, self._protected], (
            f"size_info says evictable={self._evictable} protected={self._protected}, the device tier holds "
            f"evictable={sizes[False][0]} protected={sizes[False][1]}"
        )
        assert sizes[True] == [self._host_evictable, self._host_protected], (
            f"the host tier counts evictable={self._host_evictable} protected={self._host_protected}, it holds "
            f"evictable={sizes[True][0]} protected={sizes[True][1]}"
        )
        if device_locations:
            every_location = as_int32(b"".join(device_locations))
            assert np.unique(every_location).size == every_location.size, "a device location is cached twice"
        self._candidates.check(device_candidates)
        self._host_candidates.check(host_candidates)
        if self._tier is None:
            assert not any(node.on_host or node.host_copy is not None for node in nodes), (
                "host-resident nodes (or host copies) in a cache without a host tier"
            )
        else:
            self._tier.check_integrity(nodes)

    def _check_edge(self, child: RadixNode, parent: RadixNode, first_page: bytes) -> None:
        page_size = self.page_size
        assert child.parent is parent, f"{child!r} does not point back at its parent"
        assert child.generation is parent.generation, f"{child!r} belongs to another tree"
        assert isinstance(child.key, bytes) and isinstance(child.value, bytes), f"{child!r}: key/value must be bytes"
        num_tokens = len(child.value) // BYTES_PER_TOKEN
        assert num_tokens > 0 and num_tokens % page_size == 0 and len(child.value) % BYTES_PER_TOKEN == 0, (
            f"{child!r}: edge of {len(child.value)} bytes is not a positive multiple of the page size {page_size}"
        )
        assert len(child.key) == len(child.value), (
            f"{child!r}: {len(child.key) // BYTES_PER_TOKEN} token ids for {num_tokens} locations"
        )
        assert child.key[: self._page_bytes] == first_page, f"{child!r} is filed under another first page"
        assert child.first_page == first_page, f"{child!r} keeps another first page than its key's"
        assert child.cached_len == parent.cached_len + num_tokens, f"{child!r} does not end where its path ends"
        assert child.lock_ref >= 0, f"{child!r}: negative lock count"
        assert child.last_access <= self._clock, (
            f"{child!r}: recency {child.last_access} is ahead of the clock {self._clock}"
        )
        assert not parent.on_host or child.on_host, f"{child!r} is device-resident below host-resident {parent!r}"
        if parent is not self._root:
            assert parent.last_access >= child.last_access, f"{parent!r} is older than its child {child!r}"
