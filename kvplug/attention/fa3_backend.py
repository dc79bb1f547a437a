"""``fa3``: FlashAttention-3 through sgl-kernel's ``flash_attn_with_kvcache`` (Hopper).

FA3 wants page numbers, so each step gathers the batch's table rows and keeps every P-th location
divided by P: ``page_table[rows][:, ::P] // P`` -- a ``[bs, max_pages]`` block table over the
pool's own pages ``[num_pages + 1, P, H, D]``. Queries are ragged (``cu_seqlens_q`` is the
batch's ``extend_start``) and the causal mask is aligned to the end of each request, which is
exactly "causal within the new tokens, full over the cached prefix".

sgl-kernel (the ``sgl_kernel`` module of the ``sglang-kernel`` wheel) is an optional, heavyweight install
(``pip install -e ".[fa3]"`` from the repository); the CPU CI has no use for it, and the GPU machine
gets it through ``scripts/device-fa3.sh`` (a release built for that machine's torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kvplug.attention.common import PoolAttentionBackend, check_metadata, import_optional
from kvplug.interface import AttentionBatch, AttentionConfig, InvalidArgumentError


@dataclass(frozen=True)
class FA3Metadata:
    """Attributes:
        block_table: shape ``[bs, max_pages]``, int32, gpu; page numbers per request.
        cache_seqlens: shape ``[bs]``, int32, gpu; tokens each request attends to.
        cu_seqlens_q: shape ``[bs + 1]``, int32, gpu; query offsets.
        max_seqlen_q: the most new tokens of any request (host int).
    """

    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int


class FA3AttentionBackend(PoolAttentionBackend):
    """FlashAttention-3 paged attention via sgl-kernel (see the module docstring). Options: none."""

    required_device = "cuda"

    def __init__(self, config: AttentionConfig) -> None:
        module = import_optional("sgl_kernel.flash_attn", extra="fa3", purpose="the 'fa3' attention backend")
        if config.options:
            raise InvalidArgumentError(f"the fa3 attention backend takes no options, got {sorted(config.options)}")
        super().__init__(config)
        self._flash_attn_with_kvcache: Callable[..., Any] = module.flash_attn_with_kvcache
        self._graph_table: torch.Tensor | None = None
        self._caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _block_table(self, batch: AttentionBatch, num_pages: int) -> torch.Tensor:
        """``page_table[rows][:, ::P][:, :num_pages] // P``: shape ``[bs, num_pages]``, int32, gpu."""
        rows = self.page_table.index_select(0, batch.table_rows)
        return rows[:, :: self.page_size][:, :num_pages].div(self.page_size, rounding_mode="floor")

    def prepare_metadata(self, batch: AttentionBatch) -> None:
        max_len = int(batch.device_lens_cpu.max())
        extend_start = batch.extend_start_cpu
        max_extend = int((extend_start[1:] - extend_start[:-1]).max())
        block_table = self._block_table(batch, -(-max_len // self.page_size))
        batch.metadata = FA3Metadata(block_table, batch.device_lens, batch.extend_start, max_extend)

    # ---------------------------------------------------------------- CUDA graphs
    def init_capture_graph(self, max_seq_len: int, bs_list: Sequence[int]) -> None:
        if not bs_list:
            raise InvalidArgumentError("bs_list must name at least one batch size")
        pages = -(-int(max_seq_len) // self.page_size)
        self._graph_table = torch.zeros(max(bs_list), pages, dtype=torch.int32, device=self.pool.device)

    def prepare_for_capture(self, batch: AttentionBatch) -> None:
        batch.metadata = self._graph_metadata(batch)

    def prepare_for_replay(self, batch: AttentionBatch) -> None:
        batch.metadata = self._graph_metadata(batch)

    def _graph_metadata(self, batch: AttentionBatch) -> FA3Metadata:
        if self._graph_table is None:
            raise InvalidArgumentError("call init_capture_graph(max_seq_len, bs_list) before capturing")
        if not batch.is_decode:
            raise InvalidArgumentError("only decode batches can be captured in a CUDA graph")
        bs, pages = batch.batch_size, self._graph_table.shape[1]
        if bs > self._graph_table.shape[0]:
            raise InvalidArgumentError(f"batch size {bs} exceeds the sizes given to init_capture_graph")
        table = self._graph_table[:bs]
        table.copy_(self._block_table(batch, pages))
        return FA3Metadata(table, batch.device_lens, batch.extend_start, 1)

    # ---------------------------------------------------------------- attention
    def _attend(self, q: torch.Tensor, layer_id: int, batch: AttentionBatch) -> torch.Tensor:
        metadata: FA3Metadata = check_metadata(self, batch, FA3Metadata)
        caches = self._caches.get(layer_id)
        if caches is None:
            caches = self._caches[layer_id] = (self.pool.k_cache(layer_id), self.pool.v_cache(layer_id))
        out = self._flash_attn_with_kvcache(
            q=q.contiguous(),
            k_cache=caches[0],
            v_cache=caches[1],
            page_table=metadata.block_table,
            cache_seqlens=metadata.cache_seqlens,
            cu_seqlens_q=metadata.cu_seqlens_q,
            max_seqlen_q=metadata.max_seqlen_q,
            softmax_scale=self.scale,
            causal=True,
        )
        return out.view(q.shape)
