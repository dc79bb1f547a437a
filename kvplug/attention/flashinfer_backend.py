"""``flashinfer``: FlashInfer's paged prefill/decode wrappers over the kvplug pool.

Two views of the same pool (option ``kv_view``):

- ``"token"``: the pool seen with page size 1, ``[(num_pages + 1) * P, 1, H, D]``; a request's
  table row ``page_table[row, :device_len]`` *is* FlashInfer's ``indices``.
- ``"page"``: the pool's own pages ``[num_pages + 1, P, H, D]``; indices are
  ``page_table[row, ::P] // P`` (the first location of each page over P) and the last page holds
  ``device_len - (pages - 1) * P`` tokens. Fewer indices to build and plan.

``"auto"`` (default) takes ``"page"`` when P > 1. The page lists come with a decode batch that
``KVBackend`` staged (``StagedDecodeBatch.page_lists``, written in the staging launch); for any
other batch ``PagedIndexBuilder`` writes them (one launch). Planning (``plan()``) happens once per batch in
``prepare_metadata``; every layer's ``forward`` only runs. Decode uses tensor cores from a GQA
group of 4 up (option ``use_tensor_cores``: ``"auto"``, ``True`` or ``False``). One float
workspace (option ``workspace_mb``, 128) is shared by every wrapper of the backend. CUDA-graph
decode uses FlashInfer's CUDA-graph wrapper per batch size over shared fixed index buffers.
Needs ``pip install -e ".[flashinfer]"`` from the repository.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvplug.attention.common import PoolAttentionBackend, check_metadata, import_optional
from kvplug.attention.paged_indices import PagedIndexBuilder
from kvplug.interface import AttentionBatch, AttentionConfig, InvalidArgumentError

DEFAULT_OPTIONS: dict[str, Any] = {"kv_view": "auto", "use_tensor_cores": "auto", "workspace_mb": 128}


@dataclass(frozen=True)
class FlashInferMetadata:
    """Attributes:
        wrapper: the planned FlashInfer wrapper that ``forward`` runs.
        indices: shape ``[total_pages]``, int32, gpu; kept alive until the step ends.
    """

    wrapper: Any
    indices: torch.Tensor


class FlashInferAttentionBackend(PoolAttentionBackend):
    """FlashInfer paged attention (see the module docstring)."""

    required_device = "cuda"

    def __init__(self, config: AttentionConfig) -> None:
        self._flashinfer = import_optional("flashinfer", extra="flashinfer", purpose="the 'flashinfer' attention backend")
        unknown = set(config.options) - set(DEFAULT_OPTIONS)
        if unknown:
            raise InvalidArgumentError(
                f"unknown flashinfer backend options {sorted(unknown)}; expected a subset of {sorted(DEFAULT_OPTIONS)}"
            )
        super().__init__(config)
        options = {**DEFAULT_OPTIONS, **config.options}
        kv_view = options["kv_view"]
        if kv_view not in ("auto", "token", "page"):
            raise InvalidArgumentError(f"kv_view must be 'auto', 'token' or 'page', got {kv_view!r}")
        self.kv_view = ("page" if self.page_size > 1 else "token") if kv_view == "auto" else kv_view
        tensor_cores = options["use_tensor_cores"]
        if tensor_cores not in ("auto", True, False):
            raise InvalidArgumentError(f"use_tensor_cores must be 'auto', True or False, got {tensor_cores!r}")
        self.use_tensor_cores = self.group_size >= 4 if tensor_cores == "auto" else tensor_cores
        self.view_page_size = self.page_size if self.kv_view == "page" else 1
        self.decode_page_list_size = self.view_page_size
        device = self.pool.device
        self._workspace = torch.zeros(int(options["workspace_mb"]) << 20, dtype=torch.uint8, device=device)
        self._indices = PagedIndexBuilder(self.page_table, self.view_page_size)
        self._decode_wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self._prefill_wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._graph_wrappers: dict[int, Any] = {}
        self._caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---------------------------------------------------------------- planning
    def prepare_metadata(self, batch: AttentionBatch) -> None:
        wrapper = self._decode_wrapper if batch.is_decode else self._prefill_wrapper
        batch.metadata = self._plan(wrapper, batch)

    def _plan(self, wrapper: Any, batch: AttentionBatch) -> FlashInferMetadata:
        plan = getattr(batch, "page_lists", None)  # a StagedDecodeBatch's, built with the batch
        if plan is None or plan.view_page_size != self.view_page_size or batch.page_table is not self.page_table:
            plan = self._indices.build(batch.table_rows, batch.device_lens_cpu, batch.device_lens)
        common = dict(
            num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads,
            page_size=self.view_page_size,
            q_data_type=self.pool.dtype,
            kv_data_type=self.pool.dtype,
            sm_scale=self.scale,
        )
        if batch.is_decode:
            wrapper.plan(plan.indptr, plan.indices, plan.last_page_len, head_dim=self.head_dim, **common)
        else:
            wrapper.plan(
                batch.extend_start_cpu,
                plan.indptr,
                plan.indices,
                plan.last_page_len,
                head_dim_qk=self.head_dim,
                causal=True,
                **common,
            )
        return FlashInferMetadata(wrapper, plan.indices)

    # ---------------------------------------------------------------- CUDA graphs
    def init_capture_graph(self, max_seq_len: int, bs_list: Sequence[int]) -> None:
        if not bs_list:
            raise InvalidArgumentError("bs_list must name at least one batch size")
        max_bs = max(bs_list)
        pages_per_request = -(-int(max_seq_len) // self.view_page_size)
        device = self.pool.device
        # one set of index buffers shared by every size: only one graph replays at a time and
        # each replay's plan() refills them first
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._graph_last_page_len = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self._graph_indices = torch.zeros(max_bs * pages_per_request, dtype=torch.int32, device=device)
        self._graph_wrappers = {
            bs: self._flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                self._graph_indptr[: bs + 1],
                self._graph_indices,
                self._graph_last_page_len[:bs],
                "NHD",
                use_tensor_cores=self.use_tensor_cores,
            )
            for bs in sorted(set(bs_list))
        }

    def prepare_for_capture(self, batch: AttentionBatch) -> None:
        batch.metadata = self._plan(self._graph_wrapper(batch), batch)

    def prepare_for_replay(self, batch: AttentionBatch) -> None:
        # plan() copies the new indices into the wrapper's fixed buffers the graph reads
        batch.metadata = self._plan(self._graph_wrapper(batch), batch)

    def _graph_wrapper(self, batch: AttentionBatch) -> Any:
        if not batch.is_decode:
            raise InvalidArgumentError("only decode batches can be captured in a CUDA graph")
        wrapper = self._graph_wrappers.get(batch.batch_size)
        if wrapper is None:
            raise InvalidArgumentError(
                f"no CUDA-graph wrapper for batch size {batch.batch_size}; init_capture_graph got "
                f"{sorted(self._graph_wrappers)}"
            )
        return wrapper

    # ---------------------------------------------------------------- attention
    def _paged_caches(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        caches = self._caches.get(layer_id)
        if caches is None:
            shape = (-1, self.view_page_size, self.num_kv_heads, self.head_dim)
            caches = (self.pool.k_cache(layer_id).view(shape), self.pool.v_cache(layer_id).view(shape))
            self._caches[layer_id] = caches
        return caches

    def _attend(self, q: torch.Tensor, layer_id: int, batch: AttentionBatch) -> torch.Tensor:
        metadata: FlashInferMetadata = check_metadata(self, batch, FlashInferMetadata)
        return metadata.wrapper.run(q.contiguous(), self._paged_caches(layer_id))
