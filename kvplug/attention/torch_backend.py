"""``torch``: the slow reference backend, on any device.

It is what CPU CI runs and what the GPU backends are compared with, so it favours being obviously
right over being fast: every score is computed in float32 from K/V gathered out of the pool through
the page table. Prefill/extend loops over *requests* (never tokens), each attending causally within
its new tokens and fully over its cached prefix. Decode is one vectorised masked computation over
the batch, padded to the longest request (or, inside a CUDA graph, to the captured
``max_seq_len``), which makes it capturable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvplug.attention.common import PoolAttentionBackend, check_metadata
from kvplug.interface import AttentionBatch, AttentionConfig, InvalidArgumentError


@dataclass(frozen=True)
class TorchMetadata:
    """Host-side plan of one batch.

    Attributes:
        is_decode: one new token per request.
        kv_len_bound: columns of the page table the decode path reads (>= every device_len).
        cached_lens, device_lens, extend_start: host copies (Python ints) for the prefill loop.
    """

    is_decode: bool
    kv_len_bound: int
    cached_lens: tuple[int, ...] = ()
    device_lens: tuple[int, ...] = ()
    extend_start: tuple[int, ...] = ()


class TorchAttentionBackend(PoolAttentionBackend):
    """Reference paged attention (see the module docstring). Options: none."""

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        if config.options:
            raise InvalidArgumentError(f"the torch attention backend takes no options, got {sorted(config.options)}")
        self._capture_len: int | None = None

    def prepare_metadata(self, batch: AttentionBatch) -> None:
        device_lens = batch.device_lens_cpu.tolist()
        if batch.is_decode:
            batch.metadata = TorchMetadata(True, max(device_lens))
            return
        batch.metadata = TorchMetadata(
            False,
            max(device_lens),
            tuple(batch.cached_lens_cpu.tolist()),
            tuple(device_lens),
            tuple(batch.extend_start_cpu.tolist()),
        )

    # ---------------------------------------------------------------- CUDA graphs (decode only)
    def init_capture_graph(self, max_seq_len: int, bs_list: Sequence[int]) -> None:
        width = self.page_table.shape[1]
        if not 0 < max_seq_len <= width:
            raise InvalidArgumentError(f"max_seq_len must be in [1, {width}] (the table row width), got {max_seq_len}")
        self._capture_len = int(max_seq_len)

    def prepare_for_capture(self, batch: AttentionBatch) -> None:
        batch.metadata = TorchMetadata(True, self._require_capture_len(batch))

    def prepare_for_replay(self, batch: AttentionBatch) -> None:
        # the captured kernels read rows and lengths from the batch's static tensors: nothing to copy
        batch.metadata = TorchMetadata(True, self._require_capture_len(batch))

    def _require_capture_len(self, batch: AttentionBatch) -> int:
        if self._capture_len is None:
            raise InvalidArgumentError("call init_capture_graph(max_seq_len, bs_list) before capturing")
        if not batch.is_decode:
            raise InvalidArgumentError("only decode batches can be captured in a CUDA graph")
        return self._capture_len

    # ---------------------------------------------------------------- attention
    def _attend(self, q: torch.Tensor, layer_id: int, batch: AttentionBatch) -> torch.Tensor:
        metadata: TorchMetadata = check_metadata(self, batch, TorchMetadata)
        k_flat, v_flat = self.flat_caches(layer_id)
        if metadata.is_decode:
            return self._decode(q, k_flat, v_flat, batch, metadata.kv_len_bound)
        return self._extend(q, k_flat, v_flat, batch, metadata)

    def _decode(
        self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, batch: AttentionBatch, bound: int
    ) -> torch.Tensor:
        bs, kv_heads, group, dim = q.shape[0], self.num_kv_heads, self.group_size, self.head_dim
        locations = self.page_table.index_select(0, batch.table_rows)[:, :bound]
        # entries past a request's length may be stale; clamp so the gather stays in the pool
        locations = locations.clamp(0, self.num_locations - 1).reshape(-1)
        keys = k_flat.index_select(0, locations).view(bs, bound, kv_heads, dim).float()
        values = v_flat.index_select(0, locations).view(bs, bound, kv_heads, dim).float()
        queries = q.view(bs, kv_heads, group, dim).float()
        scores = torch.einsum("bhgd,blhd->bhgl", queries, keys) * self.scale
        visible = torch.arange(bound, device=q.device).unsqueeze(0) < batch.device_lens.unsqueeze(1)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        out = torch.einsum("bhgl,blhd->bhgd", torch.softmax(scores, dim=-1), values)
        return out.reshape(bs, self.num_qo_heads, dim).to(q.dtype)

    def _extend(
        self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, batch: AttentionBatch, plan: TorchMetadata
    ) -> torch.Tensor:
        kv_heads, group, dim = self.num_kv_heads, self.group_size, self.head_dim
        out = torch.empty_like(q)
        rows = self.page_table.index_select(0, batch.table_rows)
        for i, (cached, total) in enumerate(zip(plan.cached_lens, plan.device_lens)):
            start, stop = plan.extend_start[i], plan.extend_start[i + 1]
            locations = rows[i, :total]
            keys = k_flat.index_select(0, locations).float()  # [total, kv_heads, dim]
            values = v_flat.index_select(0, locations).float()
            queries = q[start:stop].view(stop - start, kv_heads, group, dim).float()
            scores = torch.einsum("nhgd,lhd->hgnl", queries, keys) * self.scale
            query_pos = torch.arange(cached, total, device=q.device).unsqueeze(1)
            key_pos = torch.arange(total, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
            attended = torch.einsum("hgnl,lhd->nhgd", torch.softmax(scores, dim=-1), values)
            out[start:stop] = attended.reshape(stop - start, self.num_qo_heads, dim).to(q.dtype)
        return out
