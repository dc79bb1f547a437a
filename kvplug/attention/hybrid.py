"""``"P,D"``: one backend for prefill/extend batches and another for decode batches.

The plugin manager builds it for names like ``"flashinfer,triton"``. CUDA-graph capture is
decode-only, so the graph methods go to the decode backend.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvplug.interface import AttentionBatch, BaseAttentionBackend, InvalidArgumentError


class HybridAttentionBackend(BaseAttentionBackend):
    """Routes each batch by ``batch.phase``: ``PREFILL`` to ``prefill_backend``, ``DECODE`` to
    ``decode_backend``. Both must read and write the same pool."""

    def __init__(self, prefill_backend: BaseAttentionBackend, decode_backend: BaseAttentionBackend) -> None:
        for role, backend in (("prefill", prefill_backend), ("decode", decode_backend)):
            if not isinstance(backend, BaseAttentionBackend):
                raise InvalidArgumentError(
                    f"the {role} backend must be a BaseAttentionBackend, got {type(backend).__name__}"
                )
        prefill_pool = getattr(prefill_backend, "pool", None)
        decode_pool = getattr(decode_backend, "pool", None)
        if prefill_pool is not None and decode_pool is not None and prefill_pool is not decode_pool:
            raise InvalidArgumentError("the prefill and decode backends of a hybrid must share one KV pool")
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend

    @property
    def decode_page_list_size(self) -> int | None:
        """The decode backend's (see ``PoolAttentionBackend.decode_page_list_size``)."""
        return getattr(self.decode_backend, "decode_page_list_size", None)

    def _backend_for(self, batch: AttentionBatch) -> BaseAttentionBackend:
        return self.decode_backend if batch.is_decode else self.prefill_backend

    def prepare_metadata(self, batch: AttentionBatch) -> None:
        self._backend_for(batch).prepare_metadata(batch)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: AttentionBatch
    ) -> torch.Tensor:
        return self._backend_for(batch).forward(q, k, v, layer_id, batch)

    def init_capture_graph(self, max_seq_len: int, bs_list: Sequence[int]) -> None:
        self.decode_backend.init_capture_graph(max_seq_len, bs_list)

    def prepare_for_capture(self, batch: AttentionBatch) -> None:
        self.decode_backend.prepare_for_capture(batch)

    def prepare_for_replay(self, batch: AttentionBatch) -> None:
        self.decode_backend.prepare_for_replay(batch)

    def __repr__(self) -> str:
        return f"HybridAttentionBackend({type(self.prefill_backend).__name__}, {type(self.decode_backend).__name__})"
