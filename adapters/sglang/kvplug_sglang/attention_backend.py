"""``--attention-backend kvplug[:NAME]``: kvplug attention backends inside SGLang's model runner.

``KvplugAttnBackend`` is an SGLang ``AttentionBackend``. Once per forward,
``init_forward_metadata`` turns SGLang's ``ForwardBatch`` into kvplug's ``AttentionBatch`` over
SGLang's req-to-token table (``forward_batch.py``); per layer, ``forward_extend`` /
``forward_decode`` hand q, k, v to the kvplug backend (``torch``, ``triton``, ``flashinfer``,
``fa3``, ``auto`` or a ``"P,D"`` pair), which stores the new K/V at the batch's ``out_loc`` and
attends over the pool.

The kvplug backend is built per head geometry and softmax scale on first use (a model's layers
normally share one), and its ``prepare_metadata`` runs once per forward for each geometry.
It needs kvplug's pools (``pools.py``): the KV pool (it reads ``kvplug_pool``) and the table with
the dummy row; ``--kv-backend kvplug`` selects all three together. CUDA graphs are not wired.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from kvplug.interface import AttentionBatch, AttentionConfig, BaseAttentionBackend
from kvplug.plugins import PluginManager, default_manager
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from kvplug_sglang.forward_batch import attention_batch_from_forward_batch
from kvplug_sglang.pools import KvplugMHATokenToKVPool, KvplugReqToTokenPool

Geometry = tuple[int, int, int, float]  # (q heads, kv heads, head dim, softmax scale)


class KvplugAttnBackend(AttentionBackend):
    """SGLang attention backend running kvplug attention backend ``kvplug_attention``.

    Args:
        model_runner: SGLang's ``ModelRunner`` (only its two pools are read).
        kvplug_attention: kvplug attention name (``"auto"``, ``"torch"``, ..., ``"P,D"``).
        manager: kvplug plugin manager that builds the backend.
    """

    def __init__(
        self, model_runner: Any, kvplug_attention: str, manager: Callable[[], PluginManager] = default_manager
    ) -> None:
        super().__init__()
        table_pool, kv_pool = model_runner.req_to_token_pool, model_runner.token_to_kv_pool
        if not isinstance(table_pool, KvplugReqToTokenPool) or not isinstance(kv_pool, KvplugMHATokenToKVPool):
            raise ValueError(
                "--attention-backend kvplug reads kvplug's KV pool and req-to-token table, but this model "
                f"runner has {type(kv_pool).__name__} and {type(table_pool).__name__}: start SGLang with "
                "--kv-backend kvplug (the model must be a full-attention MHA/GQA model)"
            )
        self.kvplug_attention = kvplug_attention
        self.page_table = table_pool.req_to_token
        self.pool = kv_pool.kvplug_pool
        self.start_layer = kv_pool.start_layer
        self._manager = manager
        self._backends: dict[Geometry, BaseAttentionBackend] = {}
        self._prepared: dict[Geometry, AttentionBatch] = {}
        self.forward_metadata: Optional[AttentionBatch] = None

    # ------------------------------------------------------------------ per forward
    def init_forward_metadata(self, forward_batch: Any) -> None:
        self._prepared = {}
        if forward_batch.forward_mode.is_idle():
            self.forward_metadata = None
            return
        self.forward_metadata = attention_batch_from_forward_batch(forward_batch, self.page_table)

    def prepared_batch(self, layer: Any) -> tuple[BaseAttentionBackend, AttentionBatch]:
        """The kvplug backend for ``layer``'s geometry and this forward's batch, planned for it."""
        if self.forward_metadata is None:
            raise RuntimeError("kvplug attention: init_forward_metadata(forward_batch) was not called")
        geometry = (layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, float(layer.scaling))
        backend = self._backends.get(geometry)
        if backend is None:
            backend = self._backends[geometry] = self._build(geometry)
        batch = self._prepared.get(geometry)
        if batch is None:
            batch = dataclasses.replace(self.forward_metadata, metadata=None)
            backend.prepare_metadata(batch)
            self._prepared[geometry] = batch
        return backend, batch

    def _build(self, geometry: Geometry) -> BaseAttentionBackend:
        q_heads, kv_heads, head_dim, scale = geometry
        config = AttentionConfig(
            pool=self.pool,
            page_table=self.page_table,
            num_qo_heads=q_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            scale=scale,
        )
        return self._manager().create_attention_backend(self.kvplug_attention, config)

    # ------------------------------------------------------------------ per layer
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, save_kv_cache, kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, save_kv_cache, kwargs)

    def _forward(self, q, k, v, layer, save_kv_cache: bool, kwargs: dict) -> torch.Tensor:
        _check_layer(layer, kwargs)
        if k is None or v is None:
            # kvplug backends store the step's K/V themselves; a layer reusing another's KV has none
            raise NotImplementedError(
                f"kvplug attention needs layer {layer.layer_id}'s own K/V (save_kv_cache={save_kv_cache})"
            )
        backend, batch = self.prepared_batch(layer)
        return backend.forward(q, k, v, layer.layer_id - self.start_layer, batch)

    # ------------------------------------------------------------------ CUDA graphs: not wired
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise NotImplementedError(
            "kvplug attention inside SGLang runs eagerly; start with --cuda-graph-backend-decode disabled "
            "--cuda-graph-backend-prefill disabled (--kv-backend kvplug sets both)"
        )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def support_triton(self) -> bool:
        return False


def _check_layer(layer: Any, kwargs: dict) -> None:
    """Refuse attention variants kvplug backends do not compute (they would be silently wrong)."""
    problems = []
    if getattr(layer, "logit_cap", 0.0):
        problems.append(f"logit capping ({layer.logit_cap})")
    if getattr(layer, "sliding_window_size", -1) not in (-1, None):
        problems.append(f"a sliding window ({layer.sliding_window_size})")
    if getattr(layer, "is_cross_attention", False):
        problems.append("cross-attention")
    if getattr(layer, "attn_type", None) is not None and layer.attn_type.name != "DECODER":
        problems.append(f"{layer.attn_type.name} attention (kvplug attention is causal decoder attention)")
    if layer.qk_head_dim != layer.v_head_dim:
        problems.append(f"V head dim {layer.v_head_dim} != QK head dim {layer.qk_head_dim}")
    if kwargs.get("sinks") is not None:
        problems.append("attention sinks")
    if problems:
        raise NotImplementedError(f"kvplug attention (layer {layer.layer_id}) does not support {', '.join(problems)}")
