"""kvplug prefix caches over vLLM's KV blocks: one cache per namespace, locations are block slots.

vLLM keeps its block pool (block ids, reference counts, the free queue, the block table); kvplug
keeps the index. A block of ``block_size`` tokens with id ``b`` is kvplug's page ``b``: its token
locations are ``b * block_size .. b * block_size + block_size - 1``. Every block a kvplug cache
holds carries one reference of its own in vLLM's pool (``take_refs``), so vLLM never hands it out;
evicting drops that reference (``drop_refs``) and the block reaches vLLM's free queue once no
request uses it. A request using a cached prefix holds a kvplug lock on it (``lock``), so an
unlocked entry's block is referenced by kvplug alone and evicting it frees exactly one block.

Namespaces: kvplug's contract keys by token ids only, so prompts that must never share KV (other
LoRA adapter, ``cache_salt``, multimodal inputs: ``namespaces``) get their own cache, created on
first use. Eviction takes from the least recently used namespace first; inside one, the cache's
own policy decides (LRU for ``radix``).

No vLLM import: the vLLM side (``prefix_caching``) passes token ids, block ids and two callbacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, NamedTuple, Sequence

import torch

from kvplug.interface import BaseCacheHandle, BasePrefixCache, InvalidArgumentError

Namespace = Hashable
BlockRefs = Callable[[Sequence[int]], None]
_NO_TOKENS = torch.empty(0, dtype=torch.int32)


class CacheSpace:
    """One namespace: its kvplug cache and its recency (the cross-namespace LRU order)."""

    __slots__ = ("namespace", "cache", "last_used")

    def __init__(self, namespace: Namespace, cache: BasePrefixCache) -> None:
        self.namespace = namespace
        self.cache = cache
        self.last_used = 0


class BlockMatch(NamedTuple):
    """A matched prefix: ``num_tokens`` (a multiple of the block size) held in ``block_ids``."""

    space: CacheSpace
    handle: BaseCacheHandle
    num_tokens: int
    block_ids: tuple[int, ...]


@dataclass
class BlockCacheStats:
    """Cumulative counters of one ``BlockPrefixCache`` (tokens unless named otherwise)."""

    lookups: int = 0
    reused_lookups: int = 0  # answered from the per-request lookup cache (``prefix_caching``)
    query_tokens: int = 0
    hit_tokens: int = 0
    inserted_tokens: int = 0
    evicted_tokens: int = 0
    evictions: int = 0
    resets: int = 0


class BlockPrefixCache:
    """kvplug prefix caches, one per namespace, indexing vLLM blocks of ``block_size`` tokens.

    Args:
        factory: builds one empty kvplug prefix cache (page size ``block_size``, on the CPU).
        block_size: tokens per vLLM block (kvplug's page size).
        take_refs: adds one reference to each block id (kvplug caches it).
        drop_refs: removes that reference (kvplug evicted it).
    """

    def __init__(self, factory: Callable[[], BasePrefixCache], block_size: int, take_refs: BlockRefs,
                 drop_refs: BlockRefs) -> None:
        if block_size < 1:
            raise InvalidArgumentError(f"block_size must be positive, got {block_size}")
        self._factory = factory
        self.block_size = block_size
        self._take_refs = take_refs
        self._drop_refs = drop_refs
        self._spaces: dict[Namespace, CacheSpace] = {}
        self._clock = 0
        self._offsets = torch.arange(block_size, dtype=torch.int32)
        self.stats = BlockCacheStats()
        self.epoch = 0  # changes whenever a lookup's answer may have changed (insert, evict, reset)

    # ------------------------------------------------------------------ namespaces
    def space(self, namespace: Namespace) -> CacheSpace:
        space = self._spaces.get(namespace)
        if space is None:
            space = self._spaces[namespace] = CacheSpace(namespace, self._factory())
        self._clock += 1
        space.last_used = self._clock
        return space

    @property
    def namespaces(self) -> int:
        return len(self._spaces)

    # ------------------------------------------------------------------ matching and locking
    def match(self, namespace: Namespace, token_ids: Sequence[int], max_tokens: int) -> BlockMatch:
        """The longest cached prefix of ``token_ids[:max_tokens]`` (floored to whole blocks); not locked."""
        space = self.space(namespace)
        length = max(0, min(max_tokens, len(token_ids))) // self.block_size * self.block_size
        ids = torch.tensor(token_ids[:length], dtype=torch.int32) if length else _NO_TOKENS
        handle = space.cache.match_prefix(ids).handle
        num_tokens = handle.cached_len
        block_ids: tuple[int, ...] = ()
        if num_tokens:
            block_ids = tuple((handle.get_matched_indices()[:: self.block_size] // self.block_size).tolist())
        self.stats.lookups += 1
        self.stats.query_tokens += len(token_ids)
        return BlockMatch(space, handle, num_tokens, block_ids)

    def count_hit(self, num_tokens: int) -> None:
        """A match was used by an admitted request (hits are counted at admission, as vLLM does)."""
        self.stats.hit_tokens += num_tokens

    @staticmethod
    def lock(match: BlockMatch) -> None:
        if match.num_tokens:
            match.space.cache.lock_handle(match.handle)

    @staticmethod
    def unlock(match: BlockMatch) -> None:
        if match.num_tokens:
            match.space.cache.lock_handle(match.handle, unlock=True)

    # ------------------------------------------------------------------ inserting
    def insert(self, namespace: Namespace, token_ids: Sequence[int], block_ids: Sequence[int]) -> BlockMatch:
        """Cache ``token_ids`` (``len(block_ids)`` whole blocks of them) held in ``block_ids``.

        The blocks of the part that was not cached yet get kvplug's reference; the caller's copies of
        the part that was (its own hit, or another request's copy) stay the caller's to free.
        Returns the prefix the cache holds now (not locked; its ``block_ids`` are the caller's).
        """
        length = len(block_ids) * self.block_size
        if length == 0:
            raise InvalidArgumentError("nothing to insert: no whole block")
        if len(token_ids) < length:
            raise InvalidArgumentError(f"{len(block_ids)} blocks need {length} token ids, got {len(token_ids)}")
        space = self.space(namespace)
        ids = torch.tensor(token_ids[:length], dtype=torch.int32)
        blocks = torch.tensor(block_ids, dtype=torch.int32)
        locations = (blocks[:, None] * self.block_size + self._offsets).reshape(-1)
        result = space.cache.insert_prefix(ids, locations)
        # the cache keeps [cached_len, handle.cached_len) of what it was given (nothing, for naive)
        kept = result.handle.cached_len // self.block_size
        fresh = list(block_ids[result.cached_len // self.block_size:kept])
        if fresh:
            self._take_refs(fresh)
            self.stats.inserted_tokens += len(fresh) * self.block_size
            self.epoch += 1
        return BlockMatch(space, result.handle, kept * self.block_size, tuple(block_ids[:kept]))

    def adopt_loaded(self, block_ids: Sequence[int]) -> None:
        """A host load made ``block_ids`` cached blocks of kvplug's (the tiered tree holds them now)."""
        if block_ids:
            self._take_refs(block_ids)
            self.epoch += 1

    # ------------------------------------------------------------------ eviction and sizes
    @property
    def evictable_blocks(self) -> int:
        return sum(space.cache.size_info.evictable_size for space in self._spaces.values()) // self.block_size

    @property
    def cached_tokens(self) -> int:
        return sum(space.cache.size_info.total_size for space in self._spaces.values())

    @property
    def protected_tokens(self) -> int:
        return sum(space.cache.size_info.protected_size for space in self._spaces.values())

    def evict_blocks(self, num_blocks: int) -> int:
        """Evict at least ``num_blocks`` unlocked blocks (fewer only when fewer are evictable), least
        recently used namespace first; their references go back to vLLM's pool. Returns blocks freed."""
        freed = 0
        for space in sorted(self._spaces.values(), key=lambda space: space.last_used):
            if freed >= num_blocks:
                break
            wanted = min((num_blocks - freed) * self.block_size, space.cache.size_info.evictable_size)
            if wanted <= 0:
                continue
            locations = space.cache.evict(wanted)
            blocks = (locations[:: self.block_size] // self.block_size).tolist()
            self._drop_refs(blocks)
            freed += len(blocks)
        if freed:
            self.stats.evicted_tokens += freed * self.block_size
            self.stats.evictions += 1
            self.epoch += 1
        return freed

    def reset(self) -> bool:
        """Drop every cached block; ``False`` (nothing changed) while a request holds a lock."""
        if self.protected_tokens:
            return False
        for space in self._spaces.values():
            locations = space.cache.evict(space.cache.size_info.evictable_size)
            self._drop_refs((locations[:: self.block_size] // self.block_size).tolist())
            space.cache.reset()
        self._spaces.clear()
        self.stats.resets += 1
        self.epoch += 1
        return True

    def check_integrity(self) -> None:
        for space in self._spaces.values():
            space.cache.check_integrity()

    def spaces(self) -> Iterable[CacheSpace]:
        return tuple(self._spaces.values())
