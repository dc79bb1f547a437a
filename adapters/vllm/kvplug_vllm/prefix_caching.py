"""kvplug's prefix cache inside vLLM 0.32.0's scheduler, installed from ``bind_kv_cache_manager``.

vLLM builds its ``KVCacheManager`` by name in ``Scheduler.__init__`` (no seam replaces it) and hands
it to the connector right after. ``install`` swaps the class of that manager and of its
``BlockPool`` for the subclasses below, which keep vLLM's memory management (block ids, reference
counts, the free queue, the block table, preemption) and move the prefix index to kvplug
(``block_cache``):

- ``get_computed_blocks``: the hit is kvplug's match in the request's namespace, capped at
  ``num_tokens - 1`` as vLLM's own (the last token is recomputed for its logits). vLLM asks again
  for a request that stays waiting; the answer is kept per request until the cache changes
  (``BlockPrefixCache.epoch``) or the request grows.
- ``allocate_slots``: a running request's whole blocks computed by its previous steps are inserted
  into kvplug's cache (kvplug takes a reference on each newly cached block) and the request's lock
  moves onto them, so requests sharing the prefix hit it while this one still runs; a request
  admitted with a hit locks it first (so making room cannot evict the blocks it is about to
  adopt), and unlocks it when vLLM could not allocate.
- ``free`` / ``pop_blocks_for_free`` (finish, abort, preemption): the same insertion for the last
  steps, then the request's lock is released and vLLM frees its references as usual. A preempted
  request thus finds its own prefix when it is scheduled again.
- ``BlockPool.get_num_free_blocks`` counts kvplug's evictable blocks as free (vLLM counts its own
  cached, unused blocks so); ``get_new_blocks`` evicts exactly the shortage from kvplug when the
  free queue is short; ``cache_full_blocks`` / ``cache_partial_block`` do nothing, so vLLM's hash
  index stays empty.
- ``reset_prefix_cache`` empties kvplug's cache (refused, as vLLM's own, while a request runs).
- a plugin that faults is quarantined at its first fault (``quarantine``): the call runs again on
  ``naive``, no request fails.

Conservation (checked by ``check_conservation``): every block is free, held by kvplug alone
(evictable), or referenced by requests (kvplug's locked entries among them).

Every vLLM name used here is in ``compat.INTERNALS`` with its fingerprint.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple, Optional

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from kvplug.interface import InvalidArgumentError

from kvplug_vllm.block_cache import BlockMatch, BlockPrefixCache
from kvplug_vllm.namespaces import namespace_of

_ALLOCATE_SLOTS = inspect.signature(KVCacheManager.allocate_slots)


class _Lookup(NamedTuple):
    """A waiting request's last answer: valid while ``epoch`` and ``num_tokens`` are unchanged."""

    match: BlockMatch
    epoch: int
    num_tokens: int


class RequestPrefixes:
    """Per-request state of kvplug's prefix cache in vLLM's scheduler: lookups and held locks."""

    def __init__(self, cache: BlockPrefixCache) -> None:
        self.cache = cache
        self._lookups: dict[str, _Lookup] = {}
        self._held: dict[str, BlockMatch] = {}  # the locked prefix of each running request
        self._offered: dict[str, int] = {}  # whole blocks of each running request offered to the cache

    def lookup(self, request: Any) -> BlockMatch:
        rid = request.request_id
        num_tokens = request.num_tokens
        known = self._lookups.get(rid)
        if known is not None and known.epoch == self.cache.epoch and known.num_tokens == num_tokens:
            self.cache.stats.reused_lookups += 1
            return known.match
        match = self.cache.match(namespace_of(request), request.all_token_ids, num_tokens - 1)
        self._lookups[rid] = _Lookup(match, self.cache.epoch, num_tokens)
        return match

    def admit(self, request: Any, num_new_computed_tokens: int) -> Optional[BlockMatch]:
        """Lock the hit a request is admitted with; returns it (``None``: no hit, or already held)."""
        if num_new_computed_tokens <= 0 or request.request_id in self._held:
            return None
        known = self._lookups.get(request.request_id)
        if known is None or known.match.num_tokens < num_new_computed_tokens:
            raise InvalidArgumentError(
                f"vLLM admitted request {request.request_id!r} with {num_new_computed_tokens} cached tokens that "
                f"kvplug's prefix cache did not report ({known.match.num_tokens if known else 0} matched)"
            )
        self._held[request.request_id] = self.cache.lock(known.match)
        return known.match

    def admitted(self, request: Any, match: BlockMatch, allocated: bool) -> None:
        """``allocate_slots`` returned: count the hit, or give the lock back when nothing was allocated."""
        if allocated:
            self.cache.count_hit(match.num_tokens)
            self._lookups.pop(request.request_id, None)
        else:
            self.cache.unlock(self._held.pop(request.request_id))

    def hold(self, request: Any, match: BlockMatch) -> None:
        """``match`` (locked by the caller) is ``request``'s prefix now: a host load extended it."""
        held = self._held.pop(request.request_id, None)
        if held is not None:
            self.cache.unlock(held)
        self._held[request.request_id] = match

    def checkpoint(self, request: Any, blocks: list) -> None:
        """Cache ``request``'s computed whole blocks not cached by it yet, moving its lock onto them:
        a request sharing the prefix can hit it while this one still runs (vLLM caches at this
        pace too). Blocks another request cached meanwhile stay this request's private copies."""
        rid = request.request_id
        computed = min(request.num_computed_tokens - request.num_in_flight_tokens, len(request.all_token_ids))
        num_blocks = max(computed, 0) // self.cache.block_size
        if num_blocks <= self._offered.get(rid, 0):
            return
        block_ids = []
        for block in blocks[:num_blocks]:
            if block.is_null:
                break
            block_ids.append(block.block_id)
        if len(block_ids) <= self._offered.get(rid, 0):
            return
        self._offered[rid] = len(block_ids)
        inserted = self.cache.insert(namespace_of(request), request.all_token_ids, block_ids, context=request)
        locked = self.cache.lock(inserted)
        held = self._held.pop(rid, None)
        if held is not None:
            self.cache.unlock(held)
        self._held[rid] = locked

    def release(self, request: Any, blocks: list) -> None:
        """Before vLLM frees ``request``: cache its computed whole blocks, then drop its lock."""
        self._lookups.pop(request.request_id, None)
        self.checkpoint(request, blocks)
        self._offered.pop(request.request_id, None)
        held = self._held.pop(request.request_id, None)
        if held is not None:
            self.cache.unlock(held)

    @property
    def held_requests(self) -> int:
        return len(self._held)


class KvplugBlockPool(BlockPool):
    """vLLM's block pool whose cached blocks are kvplug's (see the module docstring)."""

    _kvplug: BlockPrefixCache

    def get_num_free_blocks(self) -> int:
        evictable = self._kvplug.evictable_blocks  # first: a quarantine here moves blocks to the free queue
        return self.free_block_queue.num_free_blocks + evictable

    def get_new_blocks(self, num_blocks: int) -> list:
        shortage = num_blocks - self.free_block_queue.num_free_blocks
        if shortage > 0:
            self._kvplug.evict_blocks(shortage)
        return super().get_new_blocks(num_blocks)

    def cache_full_blocks(self, *args: Any, **kwargs: Any) -> None:
        return None

    def cache_partial_block(self, *args: Any, **kwargs: Any) -> None:
        return None


class KvplugKVCacheManager(KVCacheManager):
    """vLLM's KV cache manager whose prefix hits and caching are kvplug's (see the module docstring)."""

    _kvplug: RequestPrefixes

    def get_computed_blocks(self, request: Any) -> tuple:
        if request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        match = self._kvplug.lookup(request)
        if not match.num_tokens:
            return self.empty_kv_cache_blocks, 0, 0
        pool = self.block_pool.blocks
        blocks = self.create_kv_cache_blocks(([pool[block_id] for block_id in match.block_ids],))
        return blocks, match.num_tokens, 0

    def allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        bound = _ALLOCATE_SLOTS.bind(self, request, *args, **kwargs)
        if request.num_computed_tokens:  # a running request: cache what its last step computed
            self._kvplug.checkpoint(request, self.coordinator.get_blocks(request.request_id)[0])
        match = self._kvplug.admit(request, bound.arguments.get("num_new_computed_tokens", 0))
        try:
            result = super().allocate_slots(request, *args, **kwargs)
        except BaseException:
            if match is not None:
                self._kvplug.admitted(request, match, allocated=False)
            raise
        if match is not None:
            self._kvplug.admitted(request, match, allocated=result is not None)
        return result

    def free(self, request: Any) -> None:
        self._kvplug.release(request, self.coordinator.get_blocks(request.request_id)[0])
        super().free(request)

    def pop_blocks_for_free(self, request: Any) -> list:
        self._kvplug.release(request, self.coordinator.get_blocks(request.request_id)[0])
        return super().pop_blocks_for_free(request)

    def reset_prefix_cache(self) -> bool:
        if not self._kvplug.cache.reset():
            return False
        return super().reset_prefix_cache()

    def check_conservation(self) -> None:
        """Every block is free, kvplug's alone, or referenced; raises ``AssertionError`` otherwise."""
        pool = self.block_pool
        cache = self._kvplug.cache
        free = pool.free_block_queue.num_free_blocks
        zero = sum(1 for block in pool.blocks if block.ref_cnt == 0 and not block.is_null)
        assert free == zero, f"{free} blocks in the free queue, {zero} blocks without a reference"
        cached = cache.cached_tokens // cache.block_size
        referenced = sum(1 for block in pool.blocks if block.ref_cnt > 0 and not block.is_null)
        assert cached <= referenced, f"kvplug caches {cached} blocks, only {referenced} are referenced"
        assert free + referenced == pool.num_gpu_blocks - 1, (
            f"{free} free + {referenced} referenced blocks != {pool.num_gpu_blocks - 1} (null block excluded)")
        cache.check_integrity()


def install(manager: KVCacheManager, cache_factory: Any, name: str = "prefix cache",
            events: Any = None, on_cache_failure: str = "fallback") -> RequestPrefixes:
    """Make ``manager`` (a plain ``KVCacheManager``) and its pool use kvplug's prefix cache.

    ``cache_factory()`` builds one empty kvplug prefix cache with the manager's block size as its
    page size; ``name`` is its registered name (a faulty one is quarantined: ``quarantine``);
    ``events`` gives every namespace's cache its KV event listener (``kv_events.VLLMEventRecorder``;
    ``None``: events off); ``on_cache_failure`` is ``BlockPrefixCache``'s. Raises
    ``InvalidArgumentError`` for what kvplug does not support (hybrid
    models, another manager or pool class) before changing anything.
    """
    if type(manager) is not KVCacheManager or type(manager.block_pool) is not BlockPool:
        raise InvalidArgumentError(
            f"KvplugConnector replaces vLLM's prefix caching in a plain KVCacheManager/BlockPool; got "
            f"{type(manager).__qualname__}/{type(manager.block_pool).__qualname__} (a custom scheduler or manager?)"
        )
    groups = manager.kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec) not in (FullAttentionSpec, MLAAttentionSpec):
        kinds = [type(group.kv_cache_spec).__name__ for group in groups]
        raise InvalidArgumentError(
            f"KvplugConnector supports models whose layers are all full attention (one KV cache group of "
            f"FullAttentionSpec or MLAAttentionSpec); this model has KV cache groups {kinds}"
        )
    block_size = groups[0].kv_cache_spec.block_size
    pool = manager.block_pool
    cache = BlockPrefixCache(
        cache_factory,
        block_size,
        take_refs=lambda ids: pool.touch([pool.blocks[block_id] for block_id in ids]),
        drop_refs=lambda ids: pool.free_blocks([pool.blocks[block_id] for block_id in ids]),
        name=name,
        events=events,
        on_cache_failure=on_cache_failure,
    )
    prefixes = RequestPrefixes(cache)
    pool.__class__ = KvplugBlockPool
    pool._kvplug = cache
    manager.__class__ = KvplugKVCacheManager
    manager._kvplug = prefixes
    return prefixes
