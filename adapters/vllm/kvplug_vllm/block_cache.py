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

KV events (``events``, vLLM's ``kv_events.VLLMEventRecorder``): each namespace's cache gets the
listener ``events.listener(namespace)`` (the namespace decides the hashes a router sees); while a
request's blocks are inserted, that listener's ``context`` is the request (its engine-computed block
hashes name the new pages); a quarantine clears everything published (``events.clear_all()``).

A ``PrefixCacheFault`` from any call into a cache quarantines the plugin: every namespace's cache
is handed over to the fallback (``naive``) and the call runs again on it (``quarantine``); with
``on_cache_failure="fail"`` the fault is raised instead and stops vLLM's engine.

No vLLM import: the vLLM side (``prefix_caching``) passes token ids, block ids and two callbacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, NamedTuple, Optional, Sequence

import torch

from kvplug.cache_guard import LAST_RESORT
from kvplug.interface import BaseCacheHandle, BasePrefixCache, InvalidArgumentError, PrefixCacheFault
from kvplug.prefix_cache.checked import CheckedPrefixCache

from kvplug_vllm.quarantine import BlockQuarantine

Namespace = Hashable
BlockRefs = Callable[[Sequence[int]], None]
_NO_TOKENS = torch.empty(0, dtype=torch.int32)


class CacheSpace:
    """One namespace: its kvplug cache, its recency (the cross-namespace LRU order) and the blocks
    kvplug holds a reference on for it (what a quarantine hands back, whatever the plugin says)."""

    __slots__ = ("namespace", "cache", "last_used", "blocks", "listener")

    def __init__(self, namespace: Namespace, cache: BasePrefixCache, listener: Any = None) -> None:
        self.namespace = namespace
        self.cache = cache
        self.last_used = 0
        self.blocks: set[int] = set()
        self.listener = listener  # the namespace's KV event listener (``events``), or None


class BlockMatch(NamedTuple):
    """A matched prefix: ``num_tokens`` (a multiple of the block size) held in ``block_ids``;
    ``cache`` issued ``handle`` (stale once it is no longer ``space.cache``: quarantined)."""

    space: CacheSpace
    handle: BaseCacheHandle
    num_tokens: int
    block_ids: tuple[int, ...]
    cache: BasePrefixCache

    @property
    def stale(self) -> bool:
        return self.cache is not self.space.cache

    def emptied(self) -> "BlockMatch":
        """No tokens: what a lock of a stale match holds (nothing)."""
        return self._replace(num_tokens=0, block_ids=())


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
        name: the prefix cache's registered name (messages, stats).
        fallback: builds the replacement of a faulty cache (empty, trusted); default: ``naive``.
        events: the KV event sink (``kv_events.VLLMEventRecorder``: ``listener(namespace)`` builds the
            listener of a namespace's cache, ``clear_all()`` after a quarantine), or ``None``.
        on_cache_failure: ``"fallback"`` (quarantine) or ``"fail"`` (raise: ``BlockQuarantine.stop``).
    """

    def __init__(self, factory: Callable[[], BasePrefixCache], block_size: int, take_refs: BlockRefs,
                 drop_refs: BlockRefs, name: str = "prefix cache",
                 fallback: Optional[Callable[[], BasePrefixCache]] = None,
                 events: Any = None, on_cache_failure: str = "fallback") -> None:
        if block_size < 1:
            raise InvalidArgumentError(f"block_size must be positive, got {block_size}")
        if fallback is None:
            def fallback() -> BasePrefixCache:
                from kvplug.plugins import default_manager

                return default_manager().create_prefix_cache(LAST_RESORT, device="cpu", page_size=block_size)

        self._factory = factory
        self._events = events
        self.quarantine = BlockQuarantine(name, fallback, on_cache_failure)
        self.block_size = block_size
        self._take_refs = take_refs
        self._drop_refs = drop_refs
        self._spaces: dict[Namespace, CacheSpace] = {}
        self._clock = 0
        self._offsets = torch.arange(block_size, dtype=torch.int32)
        self.stats = BlockCacheStats()
        self.epoch = 0  # changes whenever a lookup's answer may have changed (insert, evict, reset, quarantine)

    # ------------------------------------------------------------------ faults (``quarantine``)
    @property
    def name(self) -> str:
        """The prefix cache in use: the plugin's name, the fallback's once it was quarantined."""
        quarantined = self.quarantine.tripped and self.quarantine.stopped is None
        return LAST_RESORT if quarantined else self.quarantine.name

    def _guarded(self, during: str, call: Callable[[], Any]) -> Any:
        """``call()``; after a fault, the plugin quarantined, ``call()`` once more (on the fallback:
        ``call`` reads the namespace's cache when it runs). Policy ``"fail"``: the fault stops every
        call (``BlockQuarantine.stop``)."""
        self.quarantine.check_running()
        try:
            return call()
        except PrefixCacheFault as fault:
            if fault is self.quarantine.stopped:  # a nested call stopped the cache: not a second fault
                raise
            self._quarantine(fault, during)
        return call()

    def _quarantine(self, fault: PrefixCacheFault, during: str) -> None:
        self.quarantine.record(fault, during)
        dropped = kept = 0
        for space in self._spaces.values():
            if not isinstance(space.cache, CheckedPrefixCache):
                continue  # trusted (built-in) caches do not fault
            freed, held = self.quarantine.hand_over(space.cache, space.blocks, self._drop_refs)
            dropped, kept = dropped + freed, kept + held
            space.blocks = set()
            space.cache = self.quarantine.fallback()
            if space.listener is not None:
                space.cache.add_kv_event_listener(space.listener)
        if self._events is not None:  # what the plugin published is gone for event consumers
            self._events.clear_all()
        self.epoch += 1  # every lookup the faulty cache answered is stale
        self.quarantine.replaced(fault, during, dropped, kept)

    # ------------------------------------------------------------------ namespaces
    def space(self, namespace: Namespace) -> CacheSpace:
        space = self._spaces.get(namespace)
        if space is None:
            listener = self._events.listener(namespace) if self._events is not None else None
            cache = self._guarded("a namespace's creation", lambda: self._new_cache(listener))
            space = self._spaces[namespace] = CacheSpace(namespace, cache, listener)
        self._clock += 1
        space.last_used = self._clock
        return space

    def _new_cache(self, listener: Any) -> BasePrefixCache:
        cache = self.quarantine.fallback() if self.quarantine.tripped else self._factory()
        if listener is not None:
            cache.add_kv_event_listener(listener)
        return cache

    @property
    def namespaces(self) -> int:
        return len(self._spaces)

    # ------------------------------------------------------------------ matching and locking
    def match(self, namespace: Namespace, token_ids: Sequence[int], max_tokens: int) -> BlockMatch:
        """The longest cached prefix of ``token_ids[:max_tokens]`` (floored to whole blocks); not locked."""
        return self._guarded("match", lambda: self._match(namespace, token_ids, max_tokens))

    def _match(self, namespace: Namespace, token_ids: Sequence[int], max_tokens: int) -> BlockMatch:
        space = self.space(namespace)
        cache = space.cache
        length = max(0, min(max_tokens, len(token_ids))) // self.block_size * self.block_size
        ids = torch.tensor(token_ids[:length], dtype=torch.int32) if length else _NO_TOKENS
        handle = cache.match_prefix(ids).handle
        num_tokens = handle.cached_len
        block_ids: tuple[int, ...] = ()
        if num_tokens:
            block_ids = tuple((handle.get_matched_indices()[:: self.block_size] // self.block_size).tolist())
        self.stats.lookups += 1
        self.stats.query_tokens += len(token_ids)
        return BlockMatch(space, handle, num_tokens, block_ids, cache)

    def count_hit(self, num_tokens: int) -> None:
        """A match was used by an admitted request (hits are counted at admission, as vLLM does)."""
        self.stats.hit_tokens += num_tokens

    def lock(self, match: BlockMatch) -> BlockMatch:
        """Lock ``match``; returns what the lock holds (to ``unlock`` later): ``match``, or nothing
        for a match of a quarantined cache (vLLM's reference keeps its blocks)."""
        return self._guarded("lock", lambda: self._lock(match))

    @staticmethod
    def _lock(match: BlockMatch) -> BlockMatch:
        if not match.num_tokens:
            return match
        if match.stale:
            return match.emptied()
        match.cache.lock_handle(match.handle)
        return match

    def unlock(self, match: BlockMatch) -> None:
        """Release a lock ``lock`` returned."""
        self._guarded("unlock", lambda: self._unlock(match))

    def _unlock(self, match: BlockMatch) -> None:
        if not match.num_tokens:
            return
        if match.stale:  # locked before the quarantine: the hand-over kept its blocks referenced
            self.quarantine.unlock(match.handle, self._drop_refs)
            return
        match.cache.lock_handle(match.handle, unlock=True)

    # ------------------------------------------------------------------ inserting
    def insert(self, namespace: Namespace, token_ids: Sequence[int], block_ids: Sequence[int],
               context: Any = None) -> BlockMatch:
        """Cache ``token_ids`` (``len(block_ids)`` whole blocks of them) held in ``block_ids``;
        ``context`` (the vLLM request they are of) names the new pages in KV events.

        The blocks of the part that was not cached yet get kvplug's reference; the caller's copies of
        the part that was (its own hit, or another request's copy) stay the caller's to free.
        Returns the prefix the cache holds now (not locked; its ``block_ids`` are the caller's).
        """
        return self._guarded("insert", lambda: self._insert(namespace, token_ids, block_ids, context))

    def _insert(self, namespace: Namespace, token_ids: Sequence[int], block_ids: Sequence[int],
                context: Any = None) -> BlockMatch:
        length = len(block_ids) * self.block_size
        if length == 0:
            raise InvalidArgumentError("nothing to insert: no whole block")
        if len(token_ids) < length:
            raise InvalidArgumentError(f"{len(block_ids)} blocks need {length} token ids, got {len(token_ids)}")
        space = self.space(namespace)
        cache = space.cache
        ids = torch.tensor(token_ids[:length], dtype=torch.int32)
        blocks = torch.tensor(block_ids, dtype=torch.int32)
        locations = (blocks[:, None] * self.block_size + self._offsets).reshape(-1)
        listener = space.listener
        if listener is not None:
            listener.context = context
        try:
            result = cache.insert_prefix(ids, locations)
        finally:
            if listener is not None:
                listener.context = None
        # the cache keeps [cached_len, handle.cached_len) of what it was given (nothing, for naive)
        kept = result.handle.cached_len // self.block_size
        fresh = list(block_ids[result.cached_len // self.block_size:kept])
        if fresh:
            self._take_refs(fresh)
            space.blocks.update(fresh)
            self.stats.inserted_tokens += len(fresh) * self.block_size
            self.epoch += 1
        return BlockMatch(space, result.handle, kept * self.block_size, tuple(block_ids[:kept]), cache)

    def adopt_loaded(self, block_ids: Sequence[int]) -> None:
        """A host load made ``block_ids`` cached blocks of kvplug's (the tiered tree holds them now)."""
        if block_ids:
            self._take_refs(block_ids)
            self.epoch += 1

    # ------------------------------------------------------------------ eviction and sizes
    def _sizes(self, field: str) -> int:
        return sum(getattr(space.cache.size_info, field) for space in self._spaces.values())

    @property
    def evictable_blocks(self) -> int:
        return self._guarded("size_info", lambda: self._sizes("evictable_size")) // self.block_size

    @property
    def cached_tokens(self) -> int:
        """Tokens kvplug references: its caches' and the quarantine's locked blocks."""
        locked = self.quarantine.locked_blocks * self.block_size
        return self._guarded("size_info", lambda: self._sizes("total_size")) + locked

    @property
    def protected_tokens(self) -> int:
        locked = self.quarantine.locked_blocks * self.block_size
        return self._guarded("size_info", lambda: self._sizes("protected_size")) + locked

    def evict_blocks(self, num_blocks: int) -> int:
        """Evict at least ``num_blocks`` unlocked blocks (fewer only when fewer are evictable), least
        recently used namespace first; their references go back to vLLM's pool. Returns blocks freed."""
        freed = 0
        for space in sorted(self._spaces.values(), key=lambda space: space.last_used):
            if freed >= num_blocks:
                break
            # one namespace at a time: a fault in one keeps what the others freed
            wanted = num_blocks - freed
            freed += self._guarded("evict", lambda space=space, wanted=wanted: self._evict_space(space, wanted))
        if freed:
            self.stats.evicted_tokens += freed * self.block_size
            self.stats.evictions += 1
            self.epoch += 1
        return freed

    def _evict_space(self, space: CacheSpace, num_blocks: int) -> int:
        wanted = min(num_blocks * self.block_size, space.cache.size_info.evictable_size)
        if wanted <= 0:
            return 0
        locations = space.cache.evict(wanted)
        blocks = (locations[:: self.block_size] // self.block_size).tolist()
        self._drop_refs(blocks)
        space.blocks.difference_update(blocks)
        return len(blocks)

    def reset(self) -> bool:
        """Drop every cached block; ``False`` (nothing changed) while a request holds a lock."""
        if self.protected_tokens:
            return False
        return self._guarded("reset", self._reset)

    def _reset(self) -> bool:
        for space in self._spaces.values():
            locations = space.cache.evict(space.cache.size_info.evictable_size)
            blocks = (locations[:: self.block_size] // self.block_size).tolist()
            self._drop_refs(blocks)
            space.blocks.difference_update(blocks)  # a fault in a later namespace hands over only the rest
            space.cache.reset()
        self._spaces.clear()  # vLLM's BlockPool.reset_prefix_cache reports AllBlocksCleared itself
        self.stats.resets += 1
        self.epoch += 1
        return True

    def check_integrity(self) -> None:
        def check() -> None:
            for space in self._spaces.values():
                space.cache.check_integrity()

        self._guarded("check_integrity", check)

    def spaces(self) -> Iterable[CacheSpace]:
        return tuple(self._spaces.values())
