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
the dummy row; ``--kv-backend kvplug`` selects all three together.

Decode CUDA graphs, through the hooks SGLang 0.5.23's decode graph runner
(``DecodeCudaGraphRunner``, backend ``full``) calls:

- ``init_cuda_graph_state(max_bs, max_num_tokens)``: fixed decode-batch buffers
  (``graph_batches.py``) and each kvplug backend's ``init_capture_graph(row width, sizes)``;
- ``get_cuda_graph_seq_len_fill_value()``: 1, the dummy request's length;
- ``init_forward_metadata_out_graph(forward_batch, in_capture)``: before each capture
  (``in_capture=True``, every slot the dummy request) and each replay (the live requests, then
  the dummy request in SGLang's padded slots) it writes the step into the fixed buffers and plans
  the kvplug backends (``prepare_for_capture`` / ``prepare_for_replay``);
- ``init_forward_metadata_in_graph``: nothing to record (the base class's no-op): the step is in
  the fixed buffers before the replay starts.

The legacy ``init_forward_metadata_capture_cuda_graph`` / ``..._replay_cuda_graph`` hooks are not
called by 0.5.23 and not implemented. Prefill (extend) graphs and SGLang's breakable graphs are
not wired: ``--kv-backend kvplug`` keeps prefill graphs off and refuses ``breakable`` decode.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

from kvplug.decode_step import default_batch_sizes
from kvplug.interface import AttentionBatch, AttentionConfig, BaseAttentionBackend, ForwardPhase
from kvplug.plugins import PluginManager, default_manager
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend, SharedReadEnds

from kvplug_sglang.forward_batch import attention_batch_from_forward_batch, phase_of
from kvplug_sglang.graph_batches import DecodeGraphBatches
from kvplug_sglang.pools import KvplugMHATokenToKVPool, KvplugReqToTokenPool

Geometry = tuple[int, int, int, float]  # (q heads, kv heads, head dim, softmax scale)


class KvplugAttnBackend(AttentionBackend):
    """SGLang attention backend running kvplug attention backend ``kvplug_attention``.

    Args:
        model_runner: SGLang's ``ModelRunner`` (only its two pools are read).
        kvplug_attention: kvplug attention name (``"auto"``, ``"torch"``, ..., ``"P,D"``).
        manager: kvplug plugin manager that builds the backend.

    Attributes:
        cuda_graph_batch_sizes: the decode batch sizes kvplug backends prepare graph state for;
            ``None`` (default): SGLang's configured decode sizes up to ``max_bs`` (kvplug's
            ``default_batch_sizes(max_bs)`` when SGLang has published no configuration, as in a
            unit test), always with ``max_bs``. A superset of what SGLang captures is harmless.
    """

    cuda_graph_batch_sizes: Optional[Sequence[int]] = None

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
        self._graph_batches: Optional[DecodeGraphBatches] = None
        self._graph_sizes: list[int] = []
        # how prepared_batch plans this forward: "eager", or a graph batch's "capture" / "replay"
        self._planning = "eager"

    # ------------------------------------------------------------------ per forward
    def init_forward_metadata(self, forward_batch: Any) -> None:
        self._prepared = {}
        self._planning = "eager"
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
            batch = self._prepared[geometry] = self._plan(backend)
        return backend, batch

    def _plan(self, backend: BaseAttentionBackend) -> AttentionBatch:
        """This forward's batch planned by ``backend`` (its own copy: metadata is per backend)."""
        batch = dataclasses.replace(self.forward_metadata, metadata=None)
        if self._planning == "capture":
            backend.prepare_for_capture(batch)
        elif self._planning == "replay":
            backend.prepare_for_replay(batch)
        else:
            backend.prepare_metadata(batch)
        return batch

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
        backend = self._manager().create_attention_backend(self.kvplug_attention, config)
        if self._graph_batches is not None:
            # a geometry first seen in a graph warm-up forward (SGLang warms up before capturing)
            backend.init_capture_graph(self.page_table.shape[1], self._graph_sizes)
        return backend

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

    # ------------------------------------------------------------------ CUDA graphs (decode)
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed decode batches for sizes up to ``max_bs``; graph state in every kvplug backend.

        Raises:
            NotImplementedError: ``max_num_tokens != max_bs`` (a graph of several tokens per
                request, i.e. speculative verify, which kvplug attention does not run).
        """
        if max_num_tokens != max_bs:
            raise NotImplementedError(
                f"kvplug attention captures decode graphs of one token per request; SGLang asked for "
                f"{max_num_tokens} tokens over {max_bs} requests (speculative decoding is not wired)"
            )
        self._graph_sizes = _capture_batch_sizes(max_bs, self.cuda_graph_batch_sizes)
        self._graph_batches = DecodeGraphBatches(self.page_table, max_bs)
        for backend in self._backends.values():
            backend.init_capture_graph(self.page_table.shape[1], self._graph_sizes)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        # SGLang's padded slots get this length; kvplug's dummy request has length 1 too
        return 1

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """The graph batch of this capture (``in_capture``) or replay, written into the fixed
        buffers (every slot the dummy request at capture; at replay the live requests, then the
        dummy request in the ``forward_batch.num_padding`` slots SGLang padded), and planned by
        every kvplug backend built so far."""
        if phase_of(forward_batch.forward_mode) is not ForwardPhase.DECODE:
            raise NotImplementedError(
                f"kvplug attention runs SGLang {forward_batch.forward_mode.name} batches eagerly: only decode "
                "batches are captured in CUDA graphs (--kv-backend kvplug keeps --cuda-graph-backend-prefill disabled)"
            )
        if self._graph_batches is None:
            raise RuntimeError("kvplug attention: init_cuda_graph_state(max_bs, max_num_tokens) was not called")
        bs = int(forward_batch.batch_size)
        live = 0 if in_capture else bs - int(getattr(forward_batch, "num_padding", 0) or 0)
        self.forward_metadata = self._graph_batches.fill(forward_batch, live)
        self._planning = "capture" if in_capture else "replay"
        # a replay runs no Python per layer: plan every geometry now (capture plans them as the
        # warm-up forwards reach each layer, building geometries seen for the first time)
        self._prepared = {
            geometry: self._plan(backend) for geometry, backend in self._backends.items()
        }

    def shared_read_ends(self, forward_mode: Any) -> SharedReadEnds:
        # kvplug's kernels read the req-to-token table inside the layers, after SGLang's in-graph
        # marker: only the end of the forward covers those reads
        return SharedReadEnds.POST_REPLAY if forward_mode.is_decode() else SharedReadEnds.UNKNOWN

    def support_triton(self) -> bool:
        return False


def _capture_batch_sizes(max_bs: int, chosen: Optional[Sequence[int]]) -> list[int]:
    """Sizes up to ``max_bs`` kvplug backends prepare graph state for (see ``cuda_graph_batch_sizes``)."""
    if chosen is None:
        from sglang.srt.runtime_context import get_exec

        try:
            config = get_exec().graph.cuda_graph_config
        except ValueError:  # SGLang published no configuration: not inside a server
            config = None
        chosen = None if config is None else config.decode.bs
        if not chosen:
            chosen = default_batch_sizes(max_bs)
    return sorted({int(size) for size in chosen if 1 <= int(size) <= max_bs} | {max_bs})


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
