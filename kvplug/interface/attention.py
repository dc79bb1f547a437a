"""The attention-backend contract (docs/design.md, section 4): kvplug's host-neutral batch
description and the ABC.

A backend reads the KV pool and the token-granular page table; it never sees a host's request
objects. Per step the host builds one ``AttentionBatch``, calls ``prepare_metadata`` once (host
side, never captured), then ``forward`` once per layer (capturable in a CUDA graph for decode).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from kvplug.interface.kv_pool import BaseKVPool
from kvplug.interface.prefix_cache import _frozen_mapping


class ForwardPhase(enum.Enum):
    """``PREFILL`` covers prefill, extend after a cached prefix and chunked prefill; ``DECODE`` is
    exactly one new token per request."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class AttentionBatch:
    """One forward step's requests, described only by kvplug's own tables.

    Request ``i`` occupies page-table row ``table_rows[i]``; its first ``cached_lens[i]`` tokens
    already have K/V in the pool, and this forward covers tokens ``cached_lens[i] ..
    device_lens[i] - 1`` (``extend_lens[i]`` of them), whose K/V go to ``out_loc``.

    Attributes:
        phase: ``PREFILL`` or ``DECODE``.
        table_rows: shape ``[bs]``, int32, gpu (pool device).
        cached_lens: shape ``[bs]``, int32, gpu.
        device_lens: shape ``[bs]``, int32, gpu; total tokens each request attends to.
        cached_lens_cpu: shape ``[bs]``, int32, cpu; the same values, for host-side planning.
        device_lens_cpu: shape ``[bs]``, int32, cpu.
        extend_start: shape ``[bs + 1]``, int32, gpu; exclusive prefix sum of extend lengths
            (where each request's new tokens start in ``q`` / ``out_loc``).
        extend_start_cpu: shape ``[bs + 1]``, int32, cpu.
        positions: shape ``[num_tokens]``, int32, gpu; position of every new token in its request.
        out_loc: shape ``[num_tokens]``, int32, gpu; pool location of every new token.
        page_table: shape ``[max_running_reqs + 1, row_width]``, int32, gpu; the whole table
            (not a copy), so backends index it themselves.
        num_padded: how many trailing requests are dummy padding (CUDA-graph replay), 0 otherwise.
        metadata: backend-specific state set by ``prepare_metadata``; ``None`` before.
        lease: set by the ``KVBackend`` that prepared the batch (which requests it covers, so a
            batch whose request was finished since is refused instead of writing into a freed
            page); ``None`` for batches built outside a backend. Added in version 1 (optional).
    """

    phase: ForwardPhase
    table_rows: torch.Tensor
    cached_lens: torch.Tensor
    device_lens: torch.Tensor
    cached_lens_cpu: torch.Tensor
    device_lens_cpu: torch.Tensor
    extend_start: torch.Tensor
    extend_start_cpu: torch.Tensor
    positions: torch.Tensor
    out_loc: torch.Tensor
    page_table: torch.Tensor
    num_padded: int = 0
    metadata: Any = None
    lease: Any = None

    @property
    def batch_size(self) -> int:
        return int(self.table_rows.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.out_loc.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.phase is ForwardPhase.DECODE


@dataclass(frozen=True)
class AttentionConfig:
    """What an attention-backend factory receives.

    Attributes:
        pool: the KV pool the backend reads and writes.
        page_table: shape ``[max_running_reqs + 1, row_width]``, int32, pool device.
        num_qo_heads: query heads on this rank.
        num_kv_heads: KV heads on this rank (equals ``pool.local_kv_heads``).
        head_dim: elements per head.
        scale: softmax scale; ``None`` means ``head_dim ** -0.5``.
        options: backend-specific options (``"P,D"`` hybrids pass them to both halves).
    """

    pool: BaseKVPool
    page_table: torch.Tensor
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        object.__setattr__(self, "options", _frozen_mapping(self.options))

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else float(self.scale)


class BaseAttentionBackend(ABC):
    """Abstract attention backend over the kvplug pool and page table."""

    @abstractmethod
    def prepare_metadata(self, batch: AttentionBatch) -> None:
        """Host-side planning for ``batch`` (once per step, outside any captured graph); stores
        its result in ``batch.metadata``."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: AttentionBatch
    ) -> torch.Tensor:
        """Store the new K/V at ``batch.out_loc``, then attend.

        Args:
            q: shape ``[num_tokens, num_qo_heads * head_dim]`` or ``[num_tokens, num_qo_heads,
                head_dim]``, pool dtype, pool device.
            k, v: shape ``[num_tokens, num_kv_heads * head_dim]`` or ``[num_tokens,
                num_kv_heads, head_dim]``, pool dtype, pool device.
            layer_id: pool layer.

        Returns:
            shape ``[num_tokens, num_qo_heads * head_dim]``, pool dtype, pool device.
        """

    def init_capture_graph(self, max_seq_len: int, bs_list: Sequence[int]) -> None:
        """Allocate fixed capture buffers for decode batch sizes in ``bs_list``."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA-graph capture")

    def prepare_for_capture(self, batch: AttentionBatch) -> None:
        """Point ``batch.metadata`` at the capture buffers before capturing ``batch``'s size."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA-graph capture")

    def prepare_for_replay(self, batch: AttentionBatch) -> None:
        """Copy ``batch``'s (padded) metadata into the capture buffers before a replay."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA-graph capture")
