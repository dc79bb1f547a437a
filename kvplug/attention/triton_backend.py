"""``triton``: decode (split-K) and extend kernels that read the token-granular page table
directly, for any page size and GQA ratio. CUDA only; needs ``pip install -e ".[triton]"``.

Options (``AttentionConfig.options``): ``decode_block_n`` and ``decode_num_warps`` (``None``:
128 and 8 for bf16/fp16 up to head_dim 128, else 64 and 4), ``decode_num_stages`` (2),
``max_splits`` (64), ``extend_block_m`` (64), ``extend_block_n`` (64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvplug.attention.common import PoolAttentionBackend, check_metadata, import_optional
from kvplug.interface import AttentionBatch, AttentionConfig, InvalidArgumentError

DEFAULT_OPTIONS = {
    "decode_block_n": None,
    "decode_num_warps": None,
    "decode_num_stages": 2,
    "max_splits": 64,
    "extend_block_m": 64,
    "extend_block_n": 64,
}


@dataclass(frozen=True)
class TritonDecodeMetadata:
    """Attributes:
        num_splits: KV splits per request (a function of the batch size only).
        part_out: float32 scratch, gpu; at least ``bs * num_qo_heads * num_splits * pow2(head_dim)``.
        part_lse: float32 scratch, gpu; at least ``bs * num_qo_heads * num_splits``.
    """

    num_splits: int
    part_out: torch.Tensor
    part_lse: torch.Tensor


@dataclass(frozen=True)
class TritonExtendMetadata:
    """``max_extend_len``: the most new tokens of any request (host int; sizes the grid)."""

    max_extend_len: int


class TritonAttentionBackend(PoolAttentionBackend):
    """Paged attention with kvplug's Triton kernels (see the module docstring)."""

    required_device = "cuda"

    def __init__(self, config: AttentionConfig) -> None:
        import_optional("triton", extra="triton", purpose="the 'triton' attention backend")
        unknown = set(config.options) - set(DEFAULT_OPTIONS)
        if unknown:
            raise InvalidArgumentError(
                f"unknown triton backend options {sorted(unknown)}; expected a subset of {sorted(DEFAULT_OPTIONS)}"
            )
        super().__init__(config)
        from kvplug.attention.triton_kernels import decode, extend

        self._decode_kernels = decode
        self._extend_kernels = extend
        self.options = {**DEFAULT_OPTIONS, **config.options}
        self._num_sms = torch.cuda.get_device_properties(self.pool.device).multi_processor_count
        # eager scratch grows as needed; graph scratch is sized once and never freed, since
        # captured graphs keep its address
        self._eager_scratch = self._new_scratch(0)
        self._graph_scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---------------------------------------------------------------- planning
    def num_splits(self, batch_size: int) -> int:
        return self._decode_kernels.choose_num_splits(
            batch_size, self.num_kv_heads, self._num_sms, self.options["max_splits"]
        )

    def prepare_metadata(self, batch: AttentionBatch) -> None:
        if batch.is_decode:
            num_splits = self.num_splits(batch.batch_size)
            rows = batch.batch_size * self.num_qo_heads * num_splits
            if self._eager_scratch[1].numel() < rows:
                self._eager_scratch = self._new_scratch(rows)
            batch.metadata = TritonDecodeMetadata(num_splits, *self._eager_scratch)
        else:
            extend_start = batch.extend_start_cpu
            batch.metadata = TritonExtendMetadata(int((extend_start[1:] - extend_start[:-1]).max()))

    def _new_scratch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        dim_p2 = 1 << (self.head_dim - 1).bit_length()
        device = self.pool.device
        return (
            torch.empty(rows * dim_p2, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
        )

    # ---------------------------------------------------------------- CUDA graphs
    def init_capture_graph(self, max_seq_len: int, bs_list: Sequence[int]) -> None:
        if not bs_list:
            raise InvalidArgumentError("bs_list must name at least one batch size")
        rows = max(bs * self.num_qo_heads * self.num_splits(bs) for bs in bs_list)
        if self._graph_scratch is None or self._graph_scratch[1].numel() < rows:
            self._graph_scratch = self._new_scratch(rows)

    def prepare_for_capture(self, batch: AttentionBatch) -> None:
        batch.metadata = self._graph_metadata(batch)

    def prepare_for_replay(self, batch: AttentionBatch) -> None:
        # the captured kernels read rows and lengths from the batch's static tensors, and the
        # split count depends on the batch size alone, so the captured launch stays valid
        batch.metadata = self._graph_metadata(batch)

    def _graph_metadata(self, batch: AttentionBatch) -> TritonDecodeMetadata:
        if self._graph_scratch is None:
            raise InvalidArgumentError("call init_capture_graph(max_seq_len, bs_list) before capturing")
        if not batch.is_decode:
            raise InvalidArgumentError("only decode batches can be captured in a CUDA graph")
        num_splits = self.num_splits(batch.batch_size)
        if self._graph_scratch[1].numel() < batch.batch_size * self.num_qo_heads * num_splits:
            raise InvalidArgumentError(f"batch size {batch.batch_size} exceeds the sizes given to init_capture_graph")
        return TritonDecodeMetadata(num_splits, *self._graph_scratch)

    # ---------------------------------------------------------------- attention
    def _attend(self, q: torch.Tensor, layer_id: int, batch: AttentionBatch) -> torch.Tensor:
        k_flat, v_flat = self.flat_caches(layer_id)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if batch.is_decode:
            metadata: TritonDecodeMetadata = check_metadata(self, batch, TritonDecodeMetadata)
            self._decode_kernels.decode_attention(
                q,
                k_flat,
                v_flat,
                self.page_table,
                batch.table_rows,
                batch.device_lens,
                out,
                metadata.part_out,
                metadata.part_lse,
                metadata.num_splits,
                self.scale,
                block_n=self.options["decode_block_n"],
                num_warps=self.options["decode_num_warps"],
                num_stages=self.options["decode_num_stages"],
            )
            return out
        metadata: TritonExtendMetadata = check_metadata(self, batch, TritonExtendMetadata)
        self._extend_kernels.extend_attention(
            q,
            k_flat,
            v_flat,
            out,
            self.page_table,
            batch.table_rows,
            batch.cached_lens,
            batch.device_lens,
            batch.extend_start,
            metadata.max_extend_len,
            self.scale,
            block_m=self.options["extend_block_m"],
            block_n=self.options["extend_block_n"],
        )
        return out
