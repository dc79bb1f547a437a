"""``--attention-backend KVPLUG``: kvplug's attention kernels over vLLM's per-layer KV views.

vLLM allocates one KV buffer and hands every attention layer a ``[B, H, N, 2 * D]`` view of it
(``vllm/v1/worker/utils.py`` ``allocate_kv_cache``). The backend declares the ``LBNHC`` layout, so
within a block tokens are outermost: K is ``kv.transpose(1, 2)[..., :D]``, V the other half, block
``b`` is ``kv[b]``, and token slot ``b * N + t`` (vLLM's ``slot_mapping``) is row ``b * N + t`` of
the flat ``[B * N, H, D]`` K/V views kvplug's kernels read (``VllmKVViews``, a kvplug pool over
those views: no copy). kvplug's kernels take a token-granular page table; the builder expands
vLLM's block table into one (``TokenTable``) and writes each step's rows, lengths and ``out_loc``
into fixed device buffers (``BatchBuffers``), so a captured decode graph stays valid.

vLLM's padding and kvplug's dummy request: vLLM pads a batch with requests of query length 0 and
``seq_len`` 0 whose block-table rows hold the null block 0, and pads tokens with ``PAD_SLOT_ID``
(-1). kvplug gives every padding token a dummy request of length 1 on the table's last row, which
points at the null block's first slot; ``PAD_SLOT_ID`` becomes that slot too (clamped), so padding
writes only the null block, which vLLM never hands to a request.

CUDA graphs: ``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE``. ``build_for_cudagraph_capture``
sets up each kvplug backend's graph state (``init_capture_graph``, over vLLM's capture sizes) and
plans the capture; later decode steps of a captured size are planned with ``prepare_for_replay``
(FlashInfer refills its graph wrapper's buffers there), everything else with ``prepare_metadata``.

Which kvplug backend runs (``auto``: FlashInfer or Triton on CUDA, torch elsewhere) comes from
``attention_registration.kernel_name``. Unsupported attention variants (sliding window, ALiBi,
soft cap, sinks, KV sharing, encoder attention, quantized KV) are refused when the layer is built.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np
import torch

from kvplug.attention.batch import host_buffer
from kvplug.interface import (
    AttentionBatch,
    AttentionConfig,
    BaseAttentionBackend,
    BaseKVPool,
    ForwardPhase,
    InvalidArgumentError,
    KVPlugError,
)
from kvplug.plugins import default_manager
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID, PAD_SLOT_ID
from vllm.v1.kv_cache_layout import KVCacheLayout

logger = logging.getLogger(__name__)

BACKEND_NAME = "KVPLUG"
#: (query heads, softmax scale): layers sharing it share one kvplug backend and one plan per step
Geometry = tuple[int, float]


class UnsupportedAttentionError(KVPlugError, NotImplementedError):
    """A layer or batch needs an attention feature kvplug's kernels do not compute."""


# ---------------------------------------------------------------------------------- KV views
class VllmKVViews(BaseKVPool):
    """vLLM's per-layer KV views of one cache group as a kvplug pool (no copy).

    Args:
        kv_caches: one tensor per layer, in layer-id order: vLLM's logical ``[B, H, N, 2 * D]``
            view in the ``LBNHC`` layout (physically ``[B, N, H, 2 * D]``, blocks dense).
        head_dim: ``D`` (K and V heads are the same size).

    Page ``b`` of the pool is vLLM block ``b``; ``num_pages = B - 1`` because kvplug counts its
    dummy page on top, and the dummy location is vLLM's null block 0, not the last page.
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor], head_dim: int) -> None:
        if not kv_caches:
            raise InvalidArgumentError("VllmKVViews needs at least one layer's KV view")
        first = kv_caches[0]
        if first.dim() != 4 or first.shape[3] != 2 * head_dim:
            raise InvalidArgumentError(
                f"a vLLM KV view must be [blocks, kv_heads, block_size, 2 * head_dim={2 * head_dim}], got "
                f"{tuple(first.shape)}"
            )
        blocks, heads, block_size, content = first.shape
        expected = (block_size * heads * content, content, heads * content, 1)
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._flat: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer, kv in enumerate(kv_caches):
            if kv.shape != first.shape or kv.dtype != first.dtype or kv.device != first.device:
                raise InvalidArgumentError(
                    f"layer {layer}'s KV view is {tuple(kv.shape)} {kv.dtype} on {kv.device}; layer 0's is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}"
                )
            if kv.stride() != expected:
                raise InvalidArgumentError(
                    f"layer {layer}'s KV view has strides {kv.stride()}, expected {expected}: the dense LBNHC "
                    "layout (token-major blocks), which the KVPLUG backend declares; was VLLM_KV_CACHE_LAYOUT "
                    "or a KV connector's layout preference forced another one?"
                )
            nhd = kv.transpose(1, 2)  # [B, N, H, 2D]
            k, v = nhd[..., :head_dim], nhd[..., head_dim:]
            self._k.append(k)
            self._v.append(v)
            flat = (blocks * block_size, heads, head_dim)
            self._flat.append((k.view(flat), v.view(flat)))  # the strides checked above make it a view
        self.sources = tuple(kv_caches)
        self._blocks, self._heads, self._block_size, self._head_dim = blocks, heads, block_size, head_dim

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self._k[layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self._v[layer_id]

    def flat_caches(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer by slot: ``[B * N, H, D]`` each, strided views of vLLM's buffer."""
        return self._flat[layer_id]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        k_flat, v_flat = self._flat[layer_id]
        n = out_loc.shape[0]
        # advanced indexing writes through the strided views and accepts int32 indices
        k_flat[out_loc] = k.reshape(n, self._heads, self._head_dim)
        v_flat[out_loc] = v.reshape(n, self._heads, self._head_dim)

    @property
    def num_layers(self) -> int:
        return len(self._k)

    @property
    def num_pages(self) -> int:
        return self._blocks - 1

    @property
    def page_size(self) -> int:
        return self._block_size

    @property
    def local_kv_heads(self) -> int:
        return self._heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.sources[0].dtype

    @property
    def device(self) -> torch.device:
        return self.sources[0].device

    @property
    def dummy_location(self) -> int:
        """vLLM's null block's first slot: padding writes land there."""
        return NULL_BLOCK_ID * self._block_size


# ---------------------------------------------------------------------------------- step state
class TokenTable:
    """kvplug's token-granular page table over vLLM's block table.

    Rows ``0 .. max_reqs - 1`` hold request ``i`` of the current step (``table[i, j]`` is the slot
    of its token ``j``); the last row is kvplug's dummy request, all null-block slot 0.

    Args:
        max_reqs: vLLM's ``max_num_seqs``.
        blocks_per_row: vLLM's block-table width.
        block_size: tokens per (kernel) block.
        device: the KV cache's device.
    """

    def __init__(self, max_reqs: int, blocks_per_row: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.table = torch.zeros(max_reqs + 1, blocks_per_row * block_size, dtype=torch.int32, device=device)
        self.dummy_row = max_reqs
        self._offsets = torch.arange(block_size, dtype=torch.int32, device=device)

    def write(self, block_table: torch.Tensor, num_reqs: int, max_seq_len: int) -> None:
        """Expand the first ``max_seq_len`` tokens of ``block_table``'s first ``num_reqs`` rows."""
        if num_reqs == 0:
            return
        if num_reqs > self.dummy_row:
            raise InvalidArgumentError(f"{num_reqs} requests in a step; the table holds {self.dummy_row}")
        blocks = min(-(-max_seq_len // self.block_size), block_table.shape[1], self.table.shape[1] // self.block_size)
        if blocks == 0:
            return
        slots = block_table[:num_reqs, :blocks].to(torch.int32).unsqueeze(2) * self.block_size + self._offsets
        self.table[:num_reqs, : blocks * self.block_size].view(num_reqs, blocks, self.block_size).copy_(slots)


class BatchBuffers:
    """Fixed device buffers the step's ``AttentionBatch`` fields are views of: a captured graph
    reads rows, lengths and ``out_loc`` from the same addresses at every replay.

    Host layout of one step (int32; the device buffer has the same regions at capacity offsets):
    rows | cached | device | extend_start (bs + 1) | positions (tokens).
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        self._data = torch.zeros(4 * capacity + 1 + capacity, dtype=torch.int32, device=device)
        self.out_loc = torch.zeros(capacity, dtype=torch.int32, device=device)

    def batch(
        self,
        phase: ForwardPhase,
        rows: np.ndarray,
        cached: np.ndarray,
        device_lens: np.ndarray,
        extend_start: np.ndarray,
        positions: np.ndarray,
        slot_mapping: torch.Tensor,
        page_table: torch.Tensor,
        num_padded: int,
    ) -> AttentionBatch:
        bs, tokens, cap = rows.shape[0], positions.shape[0], self.capacity
        if tokens > cap:
            raise InvalidArgumentError(f"a step of {tokens} tokens exceeds the batch buffers' {cap}")
        host_tensor = host_buffer(self._data.shape[0], self.device)
        host = host_tensor.numpy()
        host[:bs] = rows
        host[cap : cap + bs] = cached
        host[2 * cap : 2 * cap + bs] = device_lens
        host[3 * cap : 3 * cap + bs + 1] = extend_start
        host[4 * cap + 1 : 4 * cap + 1 + tokens] = positions
        if self._data.device.type == "cpu":
            self._data.copy_(host_tensor)
        else:
            self._data.copy_(host_tensor, non_blocking=True)
        data = self._data
        out_loc = self.out_loc[:tokens]
        out_loc.copy_(slot_mapping[:tokens])
        out_loc.clamp_(min=PAD_SLOT_ID + 1)  # PAD_SLOT_ID -> the null block's slot 0
        return AttentionBatch(
            phase=phase,
            table_rows=data[:bs],
            cached_lens=data[cap : cap + bs],
            device_lens=data[2 * cap : 2 * cap + bs],
            cached_lens_cpu=host_tensor[cap : cap + bs],
            device_lens_cpu=host_tensor[2 * cap : 2 * cap + bs],
            extend_start=data[3 * cap : 3 * cap + bs + 1],
            extend_start_cpu=host_tensor[3 * cap : 3 * cap + bs + 1],
            positions=data[4 * cap + 1 : 4 * cap + 1 + tokens],
            out_loc=out_loc,
            page_table=page_table,
            num_padded=num_padded,
        )


def plan_step(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, num_tokens: int, dummy_row: int
) -> tuple[ForwardPhase, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """vLLM's (possibly padded) step as kvplug's batch, on the host.

    Args:
        query_start_loc: shape ``[R + 1]``, integers: vLLM's ``query_start_loc_cpu``.
        seq_lens: shape ``[R]``, integers: each request's length after this step.
        num_tokens: ``num_actual_tokens`` (padding tokens included when vLLM padded the step).
        dummy_row: the token table's dummy row.

    Returns ``(phase, rows, cached, device, extend_start, positions, num_padded)``: live requests
    (query length > 0) on rows ``0 .. L - 1``, then one dummy request (length 1, dummy row) per
    padding token ``query_start_loc[L] .. num_tokens - 1``.

    Raises:
        InvalidArgumentError: a live request after a padding one, a live request whose
            ``seq_len`` is below its query length, or fewer tokens than the live requests hold.
    """
    query_start_loc = np.asarray(query_start_loc, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    query_lens = np.diff(query_start_loc)
    live = int(np.count_nonzero(query_lens))
    if live and query_lens[:live].min() <= 0:
        raise InvalidArgumentError(
            f"vLLM's padding requests (query length 0) must follow its live ones; query lengths {query_lens.tolist()}"
        )
    live_tokens = int(query_start_loc[live])
    padded = num_tokens - live_tokens
    if padded < 0:
        raise InvalidArgumentError(f"num_actual_tokens {num_tokens} < the {live_tokens} tokens of the live requests")
    cached_live = seq_lens[:live] - query_lens[:live]
    if live and cached_live.min() < 0:
        bad = int(np.flatnonzero(cached_live < 0)[0])
        raise InvalidArgumentError(
            f"request {bad} has seq_len {seq_lens[bad]} below its query length {query_lens[bad]}"
        )
    bs = live + padded
    rows = np.full(bs, dummy_row, dtype=np.int64)
    rows[:live] = np.arange(live)
    cached = np.zeros(bs, dtype=np.int64)
    cached[:live] = cached_live
    device = np.ones(bs, dtype=np.int64)
    device[:live] = seq_lens[:live]
    extend_start = np.empty(bs + 1, dtype=np.int64)
    extend_start[: live + 1] = query_start_loc[: live + 1]
    extend_start[live + 1 :] = live_tokens + np.arange(1, padded + 1)
    positions = np.zeros(num_tokens, dtype=np.int64)
    positions[:live_tokens] = np.arange(live_tokens) + np.repeat(cached_live - query_start_loc[:live], query_lens[:live])
    decode = live == 0 or bool((query_lens[:live] == 1).all())
    phase = ForwardPhase.DECODE if decode else ForwardPhase.PREFILL
    return phase, rows, cached, device, extend_start, positions, padded


# ---------------------------------------------------------------------------------- metadata
@dataclass(frozen=True)
class KvplugAttentionMetadata:
    """One step, planned for every geometry of the cache group.

    Attributes:
        plans: geometry -> (kvplug backend, its planned batch).
        layer_ids: vLLM layer name -> kvplug pool layer.
        pool: the KV views the step was planned over.
        num_tokens: tokens kvplug computes (vLLM's ``num_actual_tokens``).
    """

    plans: Mapping[Geometry, tuple[BaseAttentionBackend, AttentionBatch]]
    layer_ids: Mapping[str, int]
    pool: VllmKVViews
    num_tokens: int


class KvplugAttentionMetadataBuilder(AttentionMetadataBuilder[KvplugAttentionMetadata]):
    """Turns vLLM's ``CommonAttentionMetadata`` into kvplug batches, once per step."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: int | None = None

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from kvplug_vllm.attention_registration import kernel_name, require_attention_internals

        require_attention_internals()  # a drifted vLLM fails here, at startup, naming what changed
        self.kernel = kernel_name(vllm_config)
        scheduler = vllm_config.scheduler_config
        self.max_reqs = int(scheduler.max_num_seqs)
        self.capacity = max(int(scheduler.max_num_batched_tokens), self.max_reqs)
        # the host copy of seq_lens is exact unless speculative decoding makes it optimistic
        self._exact_host_lens = vllm_config.speculative_config is None
        self._pool: VllmKVViews | None = None
        self._table: TokenTable | None = None
        self._buffers: BatchBuffers | None = None
        self._backends: dict[Geometry, BaseAttentionBackend] = {}
        self._layer_geometry: dict[str, Geometry] = {}
        self._layer_ids: dict[str, int] = {}
        self._graph_sizes: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ vLLM's builder API
    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> KvplugAttentionMetadata:
        return self._build(common_attn_metadata, capture=False)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> KvplugAttentionMetadata:
        return self._build(common_attn_metadata, capture=True)

    # ------------------------------------------------------------------ internals
    def _build(self, metadata: CommonAttentionMetadata, *, capture: bool) -> KvplugAttentionMetadata:
        self._ensure_state(metadata)
        table, buffers = self._table, self._buffers
        seq_lens = metadata.seq_lens_cpu_upper_bound if self._exact_host_lens else None
        if seq_lens is None:
            seq_lens = metadata.seq_lens.cpu()
        num_reqs = int(metadata.num_reqs)
        query_start_loc = metadata.query_start_loc_cpu[: num_reqs + 1].numpy()
        phase, rows, cached, device, starts, positions, padded = plan_step(
            query_start_loc, seq_lens[:num_reqs].numpy(), int(metadata.num_actual_tokens), table.dummy_row
        )
        live = rows.shape[0] - padded
        table.write(metadata.block_table_tensor, live, int(device[:live].max()) if live else 0)
        batch = buffers.batch(
            phase, rows, cached, device, starts, positions, metadata.slot_mapping, table.table, padded
        )
        if capture:
            if phase is not ForwardPhase.DECODE:
                raise UnsupportedAttentionError(
                    "KVPLUG captures CUDA graphs of single-token decode steps only "
                    f"(AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE); vLLM asked to capture a {phase.value} step"
                )
            self._init_graphs(batch.batch_size)
            mode = "capture"
        elif self._graph_sizes is not None and phase is ForwardPhase.DECODE and batch.batch_size in self._graph_sizes:
            mode = "replay"  # planned into the graph buffers, whether the step replays or runs eagerly
        else:
            mode = "eager"
        plans = {}
        for geometry, backend in self._backends.items():
            planned = dataclasses.replace(batch, metadata=None)
            if mode == "capture":
                backend.prepare_for_capture(planned)
            elif mode == "replay":
                backend.prepare_for_replay(planned)
            else:
                backend.prepare_metadata(planned)
            plans[geometry] = (backend, planned)
        return KvplugAttentionMetadata(plans, self._layer_ids, self._pool, batch.num_tokens)

    def _ensure_state(self, metadata: CommonAttentionMetadata) -> None:
        """The pool, table, buffers and kvplug backends, built at the first step (vLLM binds the
        KV caches after building the builders), rebuilt if vLLM re-allocated the KV caches."""
        layers = self._layers()
        caches = [layer.kv_cache for layer in layers]
        if self._pool is not None and all(a is b for a, b in zip(caches, self._pool.sources)):
            return
        if self._graph_sizes is not None:
            raise UnsupportedAttentionError("vLLM re-allocated the KV cache after KVPLUG captured CUDA graphs over it")
        for layer, kv in zip(layers, caches):
            if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
                raise InvalidArgumentError(
                    f"layer {layer.layer_name} has no KV cache bound yet; vLLM builds attention metadata only after "
                    "allocating it"
                )
        head_dim = int(self.kv_cache_spec.head_size)
        self._pool = VllmKVViews(caches, head_dim)
        self._layer_ids = {layer.layer_name: i for i, layer in enumerate(layers)}
        self._table = TokenTable(
            self.max_reqs, int(metadata.block_table_tensor.shape[1]), self._pool.page_size, self._pool.device
        )
        self._buffers = BatchBuffers(self.capacity, self._pool.device)
        self._backends = {}
        manager = default_manager()
        for layer in layers:
            geometry = (int(layer.impl.num_heads), float(layer.impl.scale))
            if geometry not in self._backends:
                config = AttentionConfig(
                    pool=self._pool,
                    page_table=self._table.table,
                    num_qo_heads=geometry[0],
                    num_kv_heads=self._pool.local_kv_heads,
                    head_dim=head_dim,
                    scale=geometry[1],
                )
                self._backends[geometry] = manager.create_attention_backend(self.kernel, config)
        logger.info(
            "KVPLUG attention: kvplug %r over %d layers, %d blocks x %d tokens x %d heads x %d dims (%s, %s)",
            self.kernel, len(layers), self._pool.num_pages + 1, self._pool.page_size, self._pool.local_kv_heads,
            head_dim, self._pool.dtype, self._pool.device,
        )

    def _layers(self) -> list[Any]:
        context = self.vllm_config.compilation_config.static_forward_context
        missing = [name for name in self.layer_names if name not in context]
        if missing:
            raise InvalidArgumentError(f"attention layers {missing} are not in vLLM's static forward context")
        layers = [context[name] for name in self.layer_names]
        foreign = [layer.layer_name for layer in layers if not isinstance(layer.impl, KvplugAttentionImpl)]
        if foreign:
            raise InvalidArgumentError(f"layers {foreign} of a KVPLUG cache group run another attention backend")
        return layers

    def _init_graphs(self, batch_size: int) -> None:
        if self._graph_sizes is not None:
            if batch_size not in self._graph_sizes:
                raise InvalidArgumentError(
                    f"vLLM captures a decode graph of {batch_size} requests; KVPLUG prepared {list(self._graph_sizes)}"
                )
            return
        compilation = self.vllm_config.compilation_config
        sizes = {int(size) for size in (compilation.cudagraph_capture_sizes or ()) if int(size) <= self.capacity}
        sizes.add(batch_size)
        self._graph_sizes = tuple(sorted(sizes))
        for backend in self._backends.values():
            backend.init_capture_graph(self._table.table.shape[1], self._graph_sizes)


# ---------------------------------------------------------------------------------- impl
class KvplugAttentionImpl(AttentionImpl[KvplugAttentionMetadata]):
    """Per layer: hands q, k, v to the cache group's kvplug backend, which stores K/V at the
    step's ``out_loc`` (vLLM's ``slot_mapping``) and attends."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        problems = []
        if alibi_slopes is not None:
            problems.append("ALiBi")
        if sliding_window is not None:
            problems.append(f"a sliding window ({sliding_window})")
        if logits_soft_cap:
            problems.append(f"logit soft-capping ({logits_soft_cap})")
        if attn_type != AttentionType.DECODER:
            problems.append(f"{getattr(attn_type, 'value', attn_type)} attention (kvplug computes causal decoder attention)")
        if kv_sharing_target_layer_name is not None:
            problems.append(f"KV sharing with {kv_sharing_target_layer_name}")
        if kv_cache_dtype != "auto":
            problems.append(f"kv_cache_dtype {kv_cache_dtype!r} (kvplug stores K/V in the model dtype)")
        if extra.get("sinks") is not None:
            problems.append("attention sinks")
        unknown = sorted(name for name, value in extra.items() if name != "sinks" and value not in (None, False))
        if unknown:
            problems.append(f"the options {unknown}")
        if problems:
            raise UnsupportedAttentionError(f"--attention-backend {BACKEND_NAME} does not support {', '.join(problems)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.geometry: Geometry = (num_heads, self.scale)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KvplugAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedAttentionError(f"{BACKEND_NAME} does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling and warm-up runs: no KV cache, no metadata
            return output
        layer_id = attn_metadata.layer_ids[layer.layer_name]
        if kv_cache is not attn_metadata.pool.sources[layer_id]:
            raise InvalidArgumentError(
                f"layer {layer.layer_name}'s KV cache is not the view the step was planned over"
            )
        backend, batch = attn_metadata.plans[self.geometry]
        n = attn_metadata.num_tokens
        result = backend.forward(query[:n], key[:n], value[:n], layer_id, batch)
        output[:n].copy_(result.view(n, self.num_heads, -1))
        return output


# ---------------------------------------------------------------------------------- backend
class KvplugAttentionBackend(AttentionBackend):
    """vLLM ``AttentionBackend`` ``KVPLUG`` (see the module docstring)."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[KvplugAttentionImpl]:
        return KvplugAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KvplugAttentionMetadataBuilder]:
        return KvplugAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # token-major blocks, layers outermost: block b is kv[b] and slots are flat rows
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER
