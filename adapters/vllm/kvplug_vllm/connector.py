"""``KvplugConnector``: vLLM's KV-connector seam, used to make a kvplug prefix cache vLLM's prefix cache.

Selected with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvplugConnector","kv_role":"kv_both",
                                            "kv_connector_extra_config":{"prefix_cache":"radix"}}'

(or ``LLM(..., kv_transfer_config=KVTransferConfig(...))``). vLLM builds one connector per role:

- scheduler (EngineCore): ``bind_kv_cache_manager`` installs kvplug's prefix cache into the
  scheduler's ``KVCacheManager`` (``prefix_caching``). Hits are then *local* hits of vLLM's own
  manager (blocks already in the KV pool), so the connector reports no external tokens and builds
  empty metadata; ``get_kv_connector_stats`` carries kvplug's counters into vLLM's stats pipeline
  (logged by vLLM, kept by ``stats_route`` for ``GET /kvplug/stats``), with the quarantine of a
  faulty plugin (``quarantine``; ``on_cache_failure: "fail"`` stops the engine instead);
  ``take_events`` hands kvplug's KV events to vLLM's publisher
  when ``--kv-events-config`` enables them (``kv_events``).
- worker: nothing to load or save without a host tier.

With ``host_memory`` (kvplug's host-memory tier, ``radix`` only): the tiered radix tree runs in
the scheduler and records the copies it decides (``host_copies``): write-backs of blocks kvplug
evicts, loads of host hits. A host hit is vLLM's *external* hit: ``get_num_new_matched_tokens``
reports it, ``update_state_after_alloc`` loads it into the blocks vLLM allocated
(``host_prefixes``), ``build_connector_meta`` ships the step's copies and marks the step as having
sync loads, so the worker makes them in ``start_load_kv`` before the forward (``host_tier``: the
host pages live in the worker). The host tier's page count comes from ``host_memory`` and the KV
cache's page size, the same in both processes; too small (no page) or beyond free host memory is a
startup error.

Configuration errors (unknown prefix-cache name or option, an ``on_cache_failure`` other than
``fallback``/``fail``, a ``host_memory`` that is unreadable,
below one page or beyond free host memory, an unsupported vLLM) are raised from the constructor,
which vLLM calls while starting the engine: one startup error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvplug.interface import BasePrefixCache, BaseTieredPrefixCache, InvalidArgumentError
from kvplug.memory.host_tier_size import host_tier_pages
from kvplug.plugins import default_manager
from kvplug.prefix_cache.checked import CheckedPrefixCache

from kvplug_vllm.compat import require_supported_vllm
from kvplug_vllm.host_copies import HostCopy, RecordedHostPool
from kvplug_vllm.attention_registration import check_attention_selection
from kvplug_vllm.settings import KvplugSettings, parse_settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvplug_vllm.host_prefixes import HostPrefixes
    from kvplug_vllm.host_tier import WorkerHostTier
    from kvplug_vllm.prefix_caching import RequestPrefixes

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "KvplugConnector"
#: the key marking kvplug's snapshot inside vLLM's kv_connector_stats payload
STATS_KEY = "kvplug"


@dataclass
class KvplugConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker metadata: the host tier's copies of this step, in order (empty without
    a host tier: kvplug's device hits are blocks already in vLLM's pool)."""

    host_copies: tuple[HostCopy, ...] = ()


@dataclass
class KvplugConnectorStats(KVConnectorStats):
    """kvplug's counters as vLLM connector stats: a cumulative snapshot, the latest one wins."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return other if other.data else self

    def reduce(self) -> dict[str, int | float]:
        snapshot = self.data.get(STATS_KEY, {})
        return {key: value for key, value in snapshot.items() if isinstance(value, (int, float))}

    def is_empty(self) -> bool:
        return not self.data


def prefix_cache_factory(settings: KvplugSettings, block_size: int, num_blocks: int,
                         host_pool: Optional[RecordedHostPool] = None) -> Callable[[], BasePrefixCache]:
    """A factory of empty kvplug prefix caches for vLLM blocks of ``block_size`` tokens; a cache that
    does not declare itself ``trusted`` is wrapped in kvplug's ``CheckedPrefixCache``. With
    ``settings.host_memory`` each cache is a tiered one, on a share of ``host_pool`` when given."""
    manager = default_manager()
    options = dict(settings.prefix_cache_options)
    if settings.host_memory is not None:
        options["host_memory"] = settings.host_memory

    def factory() -> BasePrefixCache:
        cache = manager.create_prefix_cache(settings.prefix_cache, device="cpu", page_size=block_size, **options)
        if settings.host_memory is not None:
            if not isinstance(cache, BaseTieredPrefixCache) or not hasattr(cache, "attach_host_pool"):
                raise InvalidArgumentError(
                    f"KvplugConnector: host_memory needs a tiered prefix cache (radix); prefix_cache="
                    f"{settings.prefix_cache!r} built {type(cache).__name__}")
            if host_pool is not None:
                cache.attach_host_pool(host_pool.share())
        if getattr(cache, "trusted", False):
            return cache
        return CheckedPrefixCache(cache, num_pages=num_blocks, page_size=block_size, name=settings.prefix_cache)

    return factory


class KvplugConnector(KVConnectorBase_V1, SupportsHMA):
    """Runs vLLM's prefix cache on a kvplug prefix cache chosen by name (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        self.vllm_version = require_supported_vllm()
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = parse_settings(self._kv_transfer_config.kv_connector_extra_config)
        check_attention_selection(vllm_config)  # kvplug attention asked for where it would not run
        self.block_size = vllm_config.cache_config.block_size
        num_blocks = getattr(kv_cache_config, "num_blocks", None) or 1
        self._factory = prefix_cache_factory(self.settings, self.block_size, num_blocks)
        self._factory()  # a wrong name or option fails here, at startup, naming what exists
        self._prefixes: Optional["RequestPrefixes"] = None
        self._reported: Optional[dict[str, Any]] = None
        self._events: Any = None  # kv_events.VLLMEventRecorder when --kv-events-config enables events
        self._host: Optional["HostPrefixes"] = None  # scheduler side of the host tier
        self._worker_tier: Optional["WorkerHostTier"] = None  # worker side
        self._host_page_bytes = self._host_pages = 0
        if self.settings.host_memory is not None:
            self._host_page_bytes, self._host_pages = host_tier_size(self.settings.host_memory, kv_cache_config)

    @property
    def host_tier(self) -> Optional["WorkerHostTier"]:
        """The worker's host pages (``None`` in the scheduler, or without ``host_memory``)."""
        return self._worker_tier

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: nothing is handed off

    # ------------------------------------------------------------------ scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        from kvplug_vllm.prefix_caching import install

        super().bind_kv_cache_manager(kv_cache_manager)
        num_blocks = kv_cache_manager.block_pool.num_gpu_blocks
        pool = None
        if self.settings.host_memory is not None:
            pool = RecordedHostPool(self._host_pages, self.block_size, self._host_page_bytes)
        self._factory = prefix_cache_factory(self.settings, self.block_size, num_blocks, pool)
        events = self._vllm_config.kv_events_config
        if events is not None and events.enable_kv_cache_events:  # vLLM publishes what take_events returns
            from kvplug_vllm.kv_events import VLLMEventRecorder

            self._events = VLLMEventRecorder(kv_cache_manager.block_pool.hash_block_size,
                                             kv_cache_manager.kv_cache_event_metadata[0])
        self._prefixes = install(kv_cache_manager, self._factory, self.settings.prefix_cache, self._events,
                                 self.settings.on_cache_failure)
        if pool is not None:
            from kvplug_vllm.host_prefixes import HostPrefixes

            self._host = HostPrefixes(self._prefixes.cache, self._prefixes, pool)
            logger.info("kvplug host tier: %d pages of %d bytes (host_memory=%d)", self._host_pages,
                        self._host_page_bytes, self.settings.host_memory)
        logger.info("kvplug prefix cache %r is vLLM's prefix cache (%d blocks of %d tokens)",
                    self.settings.prefix_cache, num_blocks, self.block_size)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        # device hits are local (get_computed_blocks counted them); host hits are external, loaded in sync
        if self._host is None:
            return 0, False
        return self._host.match(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self._host is not None:
            self._host.load(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self._host is None:
            return KvplugConnectorMetadata()
        copies = self._host.pool.take_copies()
        if copies:
            # write-backs must read reused blocks, and loads land, before this step's forward
            scheduler_output.has_sync_kv_loads = True
        return KvplugConnectorMetadata(host_copies=copies)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        if self._host is not None:
            self._host.forget(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def take_events(self) -> list:
        """kvplug's KV events since the last step, as vLLM's (``kv_events``); vLLM publishes them."""
        return self._events.take() if self._events is not None else []

    def reset_cache(self) -> Optional[bool]:
        # the scheduler resets its KVCacheManager (kvplug's cache with it) before asking the connector
        if self._host is not None and self._prefixes is not None and self._prefixes.cache.cached_tokens == 0:
            self._host.reset()
        return self._prefixes is None or self._prefixes.cache.cached_tokens == 0

    def snapshot(self) -> dict[str, Any]:
        """kvplug's counters and sizes (tokens unless named otherwise)."""
        if self._prefixes is None:
            return {"prefix_cache": self.settings.prefix_cache, "bound": False}
        cache = self._prefixes.cache
        if cache.quarantine.stopped is not None:  # on_cache_failure "fail": every size would raise the stop
            return {"prefix_cache": cache.name, **cache.quarantine.as_dict()}
        pool = self._kv_cache_manager.block_pool if self._kv_cache_manager is not None else None
        stats = cache.stats
        return {
            "prefix_cache": cache.name,
            **cache.quarantine.as_dict(),
            "block_size": cache.block_size,
            "num_blocks": pool.num_gpu_blocks if pool is not None else 0,
            "free_blocks": pool.free_block_queue.num_free_blocks if pool is not None else 0,
            "cached_tokens": cache.cached_tokens,
            "protected_tokens": cache.protected_tokens,
            "evictable_blocks": cache.evictable_blocks,
            "namespaces": cache.namespaces,
            "running_with_hits": self._prefixes.held_requests,
            "lookups": stats.lookups,
            "reused_lookups": stats.reused_lookups,
            "query_tokens": stats.query_tokens,
            "hit_tokens": stats.hit_tokens,
            "inserted_tokens": stats.inserted_tokens,
            "evicted_tokens": stats.evicted_tokens,
            "evictions": stats.evictions,
            "resets": stats.resets,
            **(self._host_snapshot() if self._host is not None else {}),
        }

    def _host_snapshot(self) -> dict[str, Any]:
        """The host tier's counters over every namespace's tree (pages, hits, write-backs, loads)."""
        snapshot: dict[str, Any] = {"host_memory": self.settings.host_memory, **self._host.snapshot()}
        totals: dict[str, int] = {}
        for space in self._prefixes.cache.spaces():
            tier = space.cache.tier_stats()
            for key in ("write_backs", "written_tokens", "loads", "loaded_tokens", "host_dropped_tokens",
                        "host_evictable_tokens", "host_protected_tokens", "reused_copy_tokens"):
                totals[key] = totals.get(key, 0) + int(getattr(tier, key))
        snapshot.update({f"host_{key}" if not key.startswith("host_") else key: value
                         for key, value in totals.items()})
        return snapshot

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        if self._prefixes is None:
            return None  # the worker side has nothing to report
        snapshot = self.snapshot()
        if snapshot == self._reported:
            return None
        self._reported = snapshot
        return KvplugConnectorStats(data={STATS_KEY: snapshot})

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> Optional[KVConnectorStats]:
        return KvplugConnectorStats(data=dict(data or {}))

    # ------------------------------------------------------------------ worker side: the host tier's copies
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.settings.host_memory is None:
            return
        from kvplug_vllm.host_tier import WorkerHostTier

        self._worker_tier = WorkerHostTier(kv_caches, self._kv_cache_config.num_blocks, self._host_pages)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker_tier is None or not self.has_connector_metadata():
            return None
        metadata = self._get_connector_metadata()
        if isinstance(metadata, KvplugConnectorMetadata) and metadata.host_copies:
            self._worker_tier.apply(metadata.host_copies)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def host_tier_size(host_memory: int, kv_cache_config: Optional["KVCacheConfig"]) -> tuple[int, int]:
    """``(bytes per host page, host pages)`` for vLLM's KV cache: a page is one block of every
    layer's K and V; ``host_tier_pages`` refuses no page or more than free host memory."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) != 1:
        raise InvalidArgumentError(
            f"KvplugConnector: host_memory needs one KV cache group (all layers full attention), got {len(groups)}")
    page_bytes = groups[0].kv_cache_spec.page_size_bytes * len(groups[0].layer_names)
    return page_bytes, host_tier_pages(host_memory, page_bytes)
