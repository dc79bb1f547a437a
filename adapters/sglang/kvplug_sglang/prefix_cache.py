"""Any kvplug prefix cache behind SGLang 0.5.23's prefix-cache API (``--radix-cache-backend kvplug:NAME``).

``KvplugPrefixCache`` is an ``sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache``: SGLang's
scheduler calls it exactly as it calls its own ``RadixCache``, and it translates each call onto a
``kvplug.BasePrefixCache`` (one per namespace, see ``cache_spaces``):

- ``match_prefix(MatchPrefixParams)`` -> ``match_prefix(token ids)``; the kvplug handle (wrapped in a
  ``CacheNode``) is what SGLang stores as ``req.last_node``;
- ``inc_lock_ref`` / ``dec_lock_ref`` (and SGLang's ``lock`` / ``unlock`` receipts built on them)
  -> ``lock_handle(handle[, unlock=True])``;
- ``checkpoint(req, up_to=...)`` (unfinished *and* finished requests; SGLang's ``release_kv_cache``
  frees what the tree did not take) -> ``insert_prefix`` of the request's page-aligned tokens and
  row locations, freeing the duplicates another request cached meanwhile and repointing the row at
  the cached copy, then moving the request's lock to the inserted prefix;
- ``evict(EvictParams)`` -> ``evict(n)``, the freed locations going back to SGLang's allocator;
- ``take_events()`` (``--kv-events-config``): the kvplug caches' KV events, translated to the
  events and block hashes SGLang's ``RadixCache`` publishes (``kv_events``).

Semantics follow SGLang's ``RadixCache``: page-aligned keys, a request's prompt boundary split off
so that evicting its output keeps its prompt, best-effort eviction (never more than is evictable).
Keys and values cross to the host (kvplug caches here live on the CPU), and matched locations go
back to the allocator's device as int64, as SGLang's own values are.

Host-memory tier (``--kvplug-host-memory SIZE``: the default namespace's cache is kvplug's tiered
``radix``, see ``radix_backends``). Evicting writes the evicted prefixes back to host memory (the
tiered cache's ``evict``) and the device locations go back to SGLang's allocator as before. A
match reports SGLang's own host-hit fields: ``device_prefix_len`` / ``last_device_node`` are the
device-resident head, ``host_hit_length`` the host-resident tail, ``best_match_node`` the whole
match. SGLang's ``PrefillAdder.add_one_req`` then, only for a request it admits, with the device
head locked and the host tokens counted in its budget, calls ``init_load_back``: the tail is locked,
device locations are taken from ``token_to_kv_pool_allocator`` (evicting through this cache's own
``evict`` when short), the host pages are copied into them (``load_host_prefix``) and the tail
becomes device-resident; SGLang then sets ``req.last_node`` to the whole match and adds the loaded
length to ``req.prefix_len`` (``load_back_is_cache_owned``: the loaded locations belong to the
tree, like any cached prefix). Without room, or when the copy fails, nothing is loaded, the
locations go back to the allocator and SGLang admits the request with the device head only (it
recomputes the tail). SGLang never sees a host location: ``path_device_indices`` is only ever
asked about device-resident nodes. Loading at admission rather than in ``match_prefix`` matters:
SGLang matches every waiting request on each scheduling pass, and loading for requests it then
does not admit would churn the pool.

Faults (issue 32). Untrusted caches (``trusted`` False) come in a ``CheckedPrefixCache``, a
``CheckedTieredPrefixCache`` with a host tier (``radix_backends``); a ``PrefixCacheFault`` from any
call this class makes into a cache (match, insert, lock, unlock, evict, sizes, reset, a namespace's
creation) quarantines the plugin and the call runs again on the ``naive`` fallback, or, with
``--kvplug-on-cache-failure fail``, stops the scheduler with the fault (``quarantine``). A fault in
``init_load_back`` (the tier's lock, eviction or load) frees the locations taken for the load and
admits the request with its device head, as a failed copy does: SGLang recomputes the tail. Each cache call is guarded on its own, so a call that
met the fault halfway (a checkpoint's second insert, one namespace of an eviction) neither repeats
what succeeded nor loses it; sizes for SGLang's lock deltas come from the wrappers' own
bookkeeping (``tracked_size_info``), so a lock is never taken twice.

Stream order (CUDA). The copies that touch the KV pool (the write-back's gather, the load's
scatter) are queued on the scheduler's current stream, SGLang 0.5.23's ``schedule_stream``. Its
overlap scheduler launches every forward on the model runner's ``forward_stream`` after
``forward_stream.wait_stream(schedule_stream)`` (``Scheduler.run_batch``), so the prefill that
reads a loaded prefix, built and launched after ``init_load_back`` returned, is ordered after the
scatter. The other direction needs a fence: the previous batch may still run on
``forward_stream`` while the next one is scheduled, and locations the allocator hands out may
still be written by it (SGLang fences its own HiCache loads and write-backs on ``forward_stream``
for this reason: ``load_fence_stream`` / ``write_fence_stream``). So before any tier copy the
current stream waits for ``forward_stream`` (``fence_stream``); that costs no GPU time (the next
forward could not start before the running one ends anyway), but the host pool's pageable index
uploads of write-backs queued after it make this thread wait for the running forward (README:
known cost; a load's go through pinned memory). Without the overlap scheduler the
forward runs on the scheduler's own stream and the fence waits on an idle stream. On the CPU every
copy is synchronous.
"""

from __future__ import annotations

import logging
import time
from array import array
import dataclasses
from typing import Any, Callable, Optional

import torch

from kvplug.interface import BasePrefixCache as KvplugBasePrefixCache
from kvplug.interface import BaseTieredPrefixCache, PrefixCacheFault, SizeInfo, TierCopyError, TierStats
from kvplug.prefix_cache.checked import CheckedPrefixCache
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvplug_sglang.cache_spaces import CacheNode, CacheSpace, CacheSpaces, Namespace
from kvplug_sglang.kv_events import SGLangEventTranslator
from kvplug_sglang.quarantine import CacheQuarantine, hand_over

logger = logging.getLogger(__name__)

_NO_TOKENS = torch.empty(0, dtype=torch.int32)


class KvplugPrefixCache(BasePrefixCache):
    """SGLang prefix cache backed by kvplug prefix caches built by ``factory()`` (e.g. ``radix``).

    Args:
        params: SGLang's ``CacheInitParams`` (pools, page size, eviction policy, ...).
        factory: ``factory(namespace)`` builds one empty kvplug prefix cache on the CPU with
            ``params.page_size`` for that namespace (a tiered one, pool attached, for a host tier).
        name: the kvplug prefix-cache name, for messages.
        fence_stream: the stream SGLang's forwards run on (``model_runner.forward_stream``) on CUDA;
            tier copies wait for it (see the module docstring). ``None``: no fence (CPU).
        on_cache_failure: ``"fallback"`` or ``"fail"`` (``--kvplug-on-cache-failure``, ``quarantine``).
        fallback: builds one empty trusted cache (``naive``) with ``params.page_size`` on the CPU,
            the replacement of a faulty one; default: kvplug's ``naive`` from the default manager.
    """

    # SGLang reads these off any tree cache; kvplug caches hold full-attention KV only
    sliding_window_size: Optional[int] = None

    def __init__(
        self,
        params: CacheInitParams,
        factory: Callable[[Namespace], KvplugBasePrefixCache],
        name: str,
        fence_stream: Any = None,
        on_cache_failure: str = "fallback",
        fallback: Optional[Callable[[], KvplugBasePrefixCache]] = None,
    ) -> None:
        if params.is_eagle:
            raise NotImplementedError(
                f"kvplug prefix cache {name!r}: EAGLE speculative decoding keys the radix tree by token "
                "bigrams, which kvplug prefix caches (keyed by token ids) do not support"
            )
        policy = (params.eviction_policy or "lru").lower()
        if policy != "lru":
            raise ValueError(
                f"kvplug prefix cache {name!r} evicts by its own policy (LRU for 'radix'); "
                f"--radix-eviction-policy must be 'lru', got {params.eviction_policy!r}"
            )
        self.name = name
        if fallback is None:
            from kvplug.plugins import default_manager

            def fallback() -> KvplugBasePrefixCache:
                return default_manager().create_prefix_cache("naive", device="cpu", page_size=params.page_size)

        self.quarantine = CacheQuarantine(name, on_cache_failure, fallback)
        self._factory = factory
        self._spaces: Optional[CacheSpaces] = None
        self._fence_stream = fence_stream
        self._warned_no_events = False
        self.disable = params.disable
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.is_eagle = False
        device = getattr(self.token_to_kv_pool_allocator, "device", "cpu")
        self.device = torch.device(device) if isinstance(device, (str, torch.device)) else torch.device("cpu")
        self._empty_indices = torch.empty(0, dtype=torch.int64, device=self.device)
        # SGLang's scheduler publishes what take_events() returns from this recorder (--kv-events-config)
        self.kv_events = KVCacheEventRecorder(
            enabled=params.enable_kv_cache_events and not self.disable,
            page_size=self.page_size,
            dynamo_format=params.dynamo_kv_event_format,
            lora_names=params.kv_event_lora_names,
        )
        listen = self._listen if self.kv_events.enabled else None
        self._spaces = self._guarded("the tree cache's construction", lambda: CacheSpaces(self._new_cache, listen))
        self.kv_events.record_all_cleared()  # as RadixCache does on construction (its first reset)
        if params.enable_metrics:
            self.init_metrics_collector()

    # ------------------------------------------------------------------ tree-wide
    @property
    def root_node(self) -> CacheNode:
        return self._guarded("root_node", lambda: self._spaces.get((None, None), touch=False)).root

    def root_node_handle(self, extra_key: Optional[str] = None) -> CacheNode:
        return self._guarded("root_node_handle", lambda: self._spaces.get((extra_key, None), touch=False)).root

    def is_root(self, node: CacheNode) -> bool:
        return node.cached_len == 0

    def reset(self) -> None:
        self._guarded("reset", self._spaces.reset)
        self.kv_events.record_all_cleared()

    # ------------------------------------------------------------------ faults (module docstring)
    def _new_cache(self, namespace: Namespace) -> KvplugBasePrefixCache:
        """A new namespace's cache: the plugin's, or the fallback once the plugin was quarantined."""
        return self.quarantine.fallback() if self.quarantine.tripped else self._factory(namespace)

    def _guarded(self, during: str, call: Callable[[], Any]) -> Any:
        """``call()``; after a fault, the plugin quarantined, ``call()`` once more (on the fallback:
        ``call`` reads the namespace's cache when it runs)."""
        try:
            return call()
        except PrefixCacheFault as fault:
            self._quarantine(fault, during)
        return call()

    def _quarantine(self, fault: PrefixCacheFault, during: str) -> None:
        """Hand every namespace's checked cache over to a fallback (or raise, policy ``fail``)."""
        self.quarantine.record(fault, during)
        evictable = locked = 0
        for space in self._spaces or ():
            old = space.cache
            if not isinstance(old, CheckedPrefixCache):
                continue
            inherited, free_now, held = hand_over(old, self.quarantine.fallback())
            evictable += free_now
            locked += held
            space.inherited = inherited
            space.replace(inherited.layer)
            if self.kv_events.enabled:  # the plugin is not called again, so it publishes nothing more
                self._listen(space)
        if self.kv_events.enabled:  # what the plugin published is gone for event consumers
            self.kv_events.record_all_cleared()
        self.quarantine.replaced(fault, during, evictable, locked)

    def _listen(self, space: CacheSpace) -> None:
        """Publish ``space``'s kvplug events through SGLang's recorder (events enabled)."""
        extra_key, cache_salt = space.namespace
        if not space.cache.add_kv_event_listener(SGLangEventTranslator(self.kv_events, extra_key, cache_salt)):
            if not self._warned_no_events:
                logger.warning(
                    "kvplug prefix cache %r publishes no KV cache events (a plugin written before kvplug's "
                    "event API): --kv-events-config will carry none of its blocks",
                    self.name,
                )
                self._warned_no_events = True

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def dfs_weight_order(self, node_handles: Any) -> list[int]:
        # kvplug caches expose no tree to walk: keep arrival order (the dfs-weight policy degrades to FCFS)
        return list(range(len(node_handles)))

    # ------------------------------------------------------------------ matching and inserting
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        return self._guarded("match_prefix", lambda: self._match_prefix(params))

    def _match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        space = self._space(key)
        ids = self._key_ids(key)
        node = space.root
        if self.disable or ids.numel() == 0:
            return MatchResult(
                device_prefix_len=0, last_device_node=node, last_host_node=node, best_match_node=node
            )
        cache = space.cache
        if not isinstance(cache, BaseTieredPrefixCache):
            node = CacheNode(space, cache.match_prefix(ids).handle)
            return MatchResult(
                device_prefix_len=node.cached_len, last_device_node=node, last_host_node=node, best_match_node=node
            )
        match = cache.match_tiered(ids)
        node = CacheNode(space, match.handle)
        whole = CacheNode(space, match.host_handle) if match.host_len else node
        return MatchResult(
            device_prefix_len=node.cached_len,
            last_device_node=node,
            last_host_node=whole,
            best_match_node=whole,
            host_hit_length=int(match.host_len),
        )

    def prefetch(self, req: Any) -> bool:
        """SGLang queued ``req`` (after ``Scheduler._prefetch_kvcache``, just before its waiting
        queue): start reading the shared KV store's pages of its prompt on the store reader's
        thread (``BaseTieredPrefixCache.prefetch``, issue 30), so the match that admits it copies
        them instead of waiting for the network. ``False``: nothing started (no tier with a store,
        disabled, or a prompt shorter than a page)."""
        if self.disable:
            return False
        tokens = list(getattr(req, "origin_input_ids", ()) or ()) + list(getattr(req, "output_ids", ()) or ())
        if len(tokens) < self.page_size:
            return False
        space = self._guarded("creating a namespace's cache", lambda: self._spaces.get(
            (getattr(req, "extra_key", None), getattr(req, "cache_salt", None)), touch=False))
        cache = space.cache
        if not isinstance(cache, BaseTieredPrefixCache):
            return False
        ids = torch.as_tensor(tokens, dtype=torch.int64).to(torch.int32)
        return bool(self._guarded("prefetch", lambda: cache.prefetch(ids)))

    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, CacheNode]:
        """Load the host-resident tail of ``params.best_match_node`` (``params.host_hit_length``
        tokens) into locations taken from SGLang's allocator; returns ``(tokens loaded, node)``:
        ``(host_hit_length, the whole match)``, or ``(0, the device head)`` when there is no room or
        the copy failed (nothing changed, SGLang recomputes the tail)."""
        whole = params.best_match_node
        cache = whole.space.cache
        host_len = params.host_hit_length
        device_node = params.req.last_node  # SGLang's PrefillAdder passes the request: its device head
        if host_len <= 0 or not isinstance(cache, BaseTieredPrefixCache):
            return 0, device_node
        if device_node.cached_len + host_len != whole.cached_len:
            raise RuntimeError(
                f"kvplug prefix cache {self.name!r}: asked to load {host_len} host tokens of a {whole.cached_len}-token "
                f"match after a device head of {device_node.cached_len} tokens"
            )
        locked = [False]
        try:
            return self._load_back(cache, whole, device_node, host_len, locked)
        except PrefixCacheFault as fault:  # the plugin's tier faulted before its answer was used
            self._quarantine(fault, "init_load_back")
            if locked[0]:  # the unlock itself faulted: the lock went over to the layer, release it there
                self._lock(whole, unlock=True)
            return 0, device_node  # the request recomputes the host tail

    def _load_back(self, cache: BaseTieredPrefixCache, whole: CacheNode, device_node: CacheNode, host_len: int,
                   locked: list) -> tuple[int, CacheNode]:
        """``init_load_back`` on ``cache``; ``locked[0]`` says whether ``whole`` is still locked here."""
        self._lock(whole, unlock=False)  # evicting to make room must neither drop nor move this path
        locked[0] = True
        try:
            locations = self._take_locations(host_len)
            if locations is None or whole.space.cache is not cache:  # no room, or an eviction quarantined it
                if locations is not None:
                    self.token_to_kv_pool_allocator.free(locations)
                logger.debug("kvplug host tier: no room to load %d tokens; the request recomputes them", host_len)
                return 0, device_node
            host_locations = locations.to("cpu", torch.int32)  # before the fence: this copy waits for its stream
            self._fence()
            try:
                cache.load_host_prefix(whole.handle, host_locations)
            except (TierCopyError, PrefixCacheFault) as error:
                # a fault after the checked wrapper took the loaded pages (a check that follows it): they
                # are the cache's now and go over to the quarantine's layer; otherwise they are free again
                if not getattr(whole.handle, "loaded", False):
                    self.token_to_kv_pool_allocator.free(locations)
                if isinstance(error, PrefixCacheFault):
                    raise
                logger.warning("kvplug host tier: a load failed (%s); the request computes those %d tokens", error, host_len)
                return 0, device_node
        finally:
            self._lock(whole, unlock=True)  # through the layer if an eviction quarantined the plugin meanwhile
            locked[0] = False
        return host_len, whole

    def _take_locations(self, count: int) -> Optional[torch.Tensor]:
        """``count`` free locations (shape ``[count]``, int64, the allocator's device), evicting
        through this cache when the allocator is short; ``None`` when even that leaves too few."""
        allocator = self.token_to_kv_pool_allocator
        short = count - allocator.available_size()
        if short > 0:
            self.evict(EvictParams(num_tokens=short))
        if allocator.available_size() < count:
            return None
        return allocator.alloc(count)

    def _fence(self) -> None:
        """Order the next tier copy after every forward already launched (module docstring)."""
        if self._fence_stream is not None:
            torch.cuda.current_stream(self._fence_stream.device).wait_stream(self._fence_stream)

    def tier_stats(self) -> TierStats:
        """The host tier's counters and sizes, summed over the namespaces that have one (all zero
        without a tier)."""
        tiers = [  # a checked plugin's counters as last asked on the scheduler's thread: the plugin is not called here
            getattr(space.cache, "tracked_tier_stats", None) or space.cache.tier_stats()
            for space in self._spaces
            if isinstance(space.cache, BaseTieredPrefixCache)
        ]
        if not tiers:
            return TierStats()
        totals = {
            field.name: sum(getattr(stats, field.name) for stats in tiers)
            for field in dataclasses.fields(TierStats)
            if field.name != "page_size"
        }
        return TierStats(page_size=tiers[0].page_size, **totals)

    def touch_prefix(self, key: RadixKey) -> None:
        ids = self._key_ids(key)
        if not self.disable and ids.numel():
            space = self._space(key)
            self._guarded("touch_prefix", lambda: space.cache.match_prefix(ids))

    def insert(self, params: InsertParams) -> InsertResult:
        """Cache ``params.key`` (page-aligned) at ``params.value`` (shape ``[n]``, int64, any device).
        Without a value the token ids stand in for locations (SGLang's simulation convention)."""
        space = self._space(params.key)
        ids = self._key_ids(params.key)
        if self.disable or ids.numel() == 0:
            return InsertResult(prefix_len=0, last_device_node=space.root)
        value = ids if params.value is None else params.value[: ids.numel()].to("cpu", torch.int32)
        result = self._guarded("insert", lambda: space.cache.insert_prefix(ids, value))
        return InsertResult(prefix_len=result.cached_len, last_device_node=CacheNode(space, result.handle))

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        if self.disable:
            return
        key = RadixKey(req.full_untruncated_fill_ids[:up_to], req.extra_key, cache_salt=req.cache_salt)
        space = self._space(key)
        ids = self._key_ids(key)
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        locations = row[: ids.numel()].to("cpu", torch.int32)
        during = "cache_finished_req" if req.finished() else "cache_unfinished_req"
        result = self._guarded(during, lambda: space.cache.insert_prefix(ids, locations))
        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, ids.numel())
        # split at the page-aligned prompt end, so evicting the output leaves the prompt cached
        prompt_len = len(req.origin_input_ids) // self.page_size * self.page_size
        if 0 < prompt_len < ids.numel() and result.handle.cached_len == ids.numel():
            self._guarded(during, lambda: space.cache.insert_prefix(ids[:prompt_len], locations[:prompt_len]))
        protected = req.kv.cache_protected_len
        if result.cached_len > protected:  # another request cached these first: free our copies
            self.token_to_kv_pool_allocator.free_segment(row[protected : result.cached_len], start_pos=protected)
        held = result.handle.cached_len
        if held < protected:
            raise RuntimeError(
                f"kvplug prefix cache {self.name!r} holds {held} tokens of request {req.rid} after inserting "
                f"{ids.numel()}, less than the {protected} it had locked"
            )
        if held > protected:
            cached = result.handle.get_matched_indices()[protected:held]
            self.req_to_token_pool.write((req.kv.req_pool_idx, slice(protected, held)), cached.to(row.device))
        req.kv.cache_protected_len = held
        node = CacheNode(space, result.handle)
        self.unlock(req.lock)
        req.lock = self.lock(node)
        req.last_node = node

    def path_device_indices(self, node: CacheNode) -> torch.Tensor:
        """Locations of ``node``'s prefix: shape ``[cached_len]``, int64, the allocator's device."""
        if node.cached_len == 0:
            return self._empty_indices
        return node.handle.get_matched_indices().to(self.device, torch.int64)

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: CacheNode) -> IncLockRefResult:
        if self.disable or node.cached_len == 0:
            return IncLockRefResult(delta=0)
        return IncLockRefResult(delta=self._guarded("inc_lock_ref", lambda: self._lock(node, unlock=False)))

    def dec_lock_ref(self, node: CacheNode, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        if self.disable or node.cached_len == 0:
            return DecLockRefResult(delta=0)
        return DecLockRefResult(delta=self._guarded("dec_lock_ref", lambda: self._lock(node, unlock=True)))

    def _lock(self, node: CacheNode, *, unlock: bool) -> int:
        """Lock or unlock ``node`` (one issued by a quarantined cache through the layer that holds
        its pages now); returns the change of the evictable size (SGLang's ``delta``)."""
        space = node.space
        cache, handle = space.cache, node.handle
        if space.inherited is not None and space.inherited.is_stale(handle):
            handle = space.inherited.handle_for(handle)
        before = _tracked_size(cache).evictable_size
        cache.lock_handle(handle, unlock=unlock)
        return _tracked_size(cache).evictable_size - before

    # ------------------------------------------------------------------ eviction and sizes
    def evict(self, params: EvictParams) -> EvictResult:
        """Evict up to ``params.num_tokens`` unlocked tokens (at least that many while there are)."""
        wanted = params.num_tokens
        if self.disable or wanted <= 0:
            return EvictResult()
        start = time.perf_counter()
        num_freed = 0
        for space in self._spaces.least_recently_used_first():
            # one namespace at a time: a fault in one keeps what the others freed
            evicted = self._guarded("evict", lambda: self._evict_space(space, wanted - num_freed))
            if evicted.numel():
                self.token_to_kv_pool_allocator.free(evicted.to(self.device, torch.int64))
                num_freed += evicted.numel()
            if num_freed >= wanted:
                break
        self.update_eviction_metrics(num_freed, start)
        return EvictResult(num_tokens_evicted=num_freed)

    def _evict_space(self, space: CacheSpace, wanted: int) -> torch.Tensor:
        """Up to ``wanted`` tokens evicted from ``space`` (shape ``[n]``, int32, cpu)."""
        take = min(wanted, space.cache.size_info.evictable_size)
        if take <= 0:
            return _NO_TOKENS
        if isinstance(space.cache, BaseTieredPrefixCache):
            self._fence()  # the write-back reads the evicted pages
        evicted = space.cache.evict(take)
        if space.inherited is not None:
            space.inherited.evicted(evicted)
        return evicted

    def evictable_size(self) -> int:
        return self._guarded("evictable_size", self._spaces.evictable_size)

    def protected_size(self) -> int:
        return self._guarded("protected_size", self._spaces.protected_size)

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def full_protected_size(self) -> int:
        return self.protected_size()

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def sanity_check(self) -> None:
        for space in self._spaces:
            self._guarded("sanity_check", lambda: space.cache.check_integrity())

    def pretty_print(self) -> None:
        for space in self._spaces:
            size = self._guarded("pretty_print", lambda: space.cache.size_info)
            print(f"kvplug prefix cache {self.name!r} namespace {space.namespace!r}: {size}")

    # ------------------------------------------------------------------ keys
    def _space(self, key: RadixKey) -> CacheSpace:
        return self._guarded("creating a namespace's cache", lambda: self._spaces.get((key.extra_key, key.cache_salt)))

    def _key_ids(self, key: RadixKey) -> torch.Tensor:
        """The page-aligned key as token ids: shape ``[n]``, int32, cpu."""
        if key.is_bigram:
            raise NotImplementedError(f"kvplug prefix cache {self.name!r} cannot key by token bigrams (EAGLE)")
        tokens = key.raw_token_ids()
        length = len(tokens) // self.page_size * self.page_size
        if length == 0:
            return _NO_TOKENS
        if isinstance(tokens, array) and tokens.typecode == "q":
            return torch.frombuffer(tokens, dtype=torch.int64, count=length).to(torch.int32)
        return torch.as_tensor(list(tokens[:length]), dtype=torch.int64).to(torch.int32)


def _tracked_size(cache: KvplugBasePrefixCache) -> SizeInfo:
    """``cache``'s sizes, from a wrapper's own bookkeeping when it has one (no plugin call)."""
    tracked = getattr(cache, "tracked_size_info", None)
    return tracked if tracked is not None else cache.size_info
