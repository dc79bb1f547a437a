"""Shared by ``test_sglang_graphs.py`` (CPU) and ``test_sglang_graphs_gpu.py``: a decode world over
kvplug's pools in SGLang's classes, and SGLang's own decode graph-runner inputs.

``GraphWorld`` holds ``requests`` requests in a ``KvplugReqToTokenPool`` (rows picked from SGLang's
free list) with K/V in a ``KvplugMHATokenToKVPool``; every request's pages are scattered over the
pool, never SGLang's padding page 0. ``decode_batch(requests)`` grows each request by one token
and describes the step as SGLang's model runner does (an SGLang ``ForwardBatch``).

``RunnerInputs`` is what SGLang 0.5.23's ``DecodeCudaGraphRunner`` hands an attention backend,
built with SGLang's own code: the decode buffer registry (``build_decode_registry``, whose padding
policy fills the slots after the live requests: ``req_pool_indices`` 0, ``seq_lens`` the
backend's fill value), the capture-time ``ForwardBatch`` over those buffers (as
``capture_prepare`` builds it, index buffers zeroed) and the replay view
(``build_replay_fb_view``; on the GPU machine, which cannot import SGLang's graph-runner module,
``replica_replay_view``, checked against SGLang's on the CPU).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import torch

# head_dim 64: the smallest FlashInfer compiles (its merge-states kernel refuses 16); real models use 64-256
Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 64, 2


class GraphWorld:
    """Requests with cached K/V in kvplug's pools as SGLang's configurator builds them.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        page_size: tokens per page.
        dtype: pool dtype.
        prefix_lens: one request per entry, with that many tokens' K/V already in the pool.
        max_context: the table's row width.
        seed: of every random tensor.
    """

    def __init__(
        self, device: str, page_size: int, dtype: torch.dtype, prefix_lens: Sequence[int], max_context: int = 64,
        seed: int = 0,
    ) -> None:
        from kvplug_sglang.pools import KvplugMHATokenToKVPool, KvplugReqToTokenPool

        self.device, self.page_size, self.dtype = device, page_size, dtype
        self.generator = torch.Generator().manual_seed(seed)
        num_pages = len(prefix_lens) * (max_context // page_size + 1) + 1
        self.table = KvplugReqToTokenPool(
            size=len(prefix_lens) + 2, max_context_len=max_context, device=device, enable_memory_saver=False
        )
        self.kv = KvplugMHATokenToKVPool(
            size=num_pages * page_size, page_size=page_size, dtype=dtype, head_num=KV_HEADS, head_dim=HEAD_DIM,
            layer_num=LAYERS, device=device, enable_memory_saver=False,
        )
        self.runner = SimpleNamespace(device=device, req_to_token_pool=self.table, token_to_kv_pool=self.kv)
        self.layers = [
            SimpleNamespace(  # what SGLang's RadixAttention tells a backend about itself
                layer_id=layer, tp_q_head_num=Q_HEADS, tp_k_head_num=KV_HEADS, qk_head_dim=HEAD_DIM,
                v_head_dim=HEAD_DIM, scaling=HEAD_DIM**-0.5, logit_cap=0.0, sliding_window_size=-1,
                is_cross_attention=False, attn_type=None,
            )
            for layer in range(LAYERS)
        ]
        # SGLang's allocators never hand out page 0 (its padding page); take the others shuffled
        order = torch.randperm(num_pages, generator=self.generator) + 1
        self.free_pages = order.tolist()
        self.rows: list[int] = []
        self.lens: list[int] = []
        self.pages: list[list[int]] = []
        for prefix in prefix_lens:
            self.rows.append(self.table.alloc_rows(1)[0])
            self.lens.append(0)
            self.pages.append([])
            locations = self._grow(len(self.rows) - 1, prefix)
            for layer in range(LAYERS):
                self.kv.k_buffer[layer][locations] = self.random(prefix, KV_HEADS, HEAD_DIM)
                self.kv.v_buffer[layer][locations] = self.random(prefix, KV_HEADS, HEAD_DIM)
        # the rows SGLang would pad with (0) and kvplug's dummy row both point at SGLang's padding slot
        assert self.table.req_to_token[0].eq(0).all() and self.table.req_to_token[self.table.dummy_row].eq(0).all()
        assert 0 not in self.rows and self.table.dummy_row not in self.rows

    @property
    def dummy_locations(self) -> range:
        """Locations padded slots may write: kvplug's dummy row points at the first of SGLang's
        padding page."""
        return range(0, 1)

    def random(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(self.dtype).to(self.device)

    def _grow(self, request: int, count: int) -> torch.Tensor:
        """``count`` more token locations for ``request``, written into its table row."""
        start = self.lens[request]
        locations = []
        for position in range(start, start + count):
            if position % self.page_size == 0:
                self.pages[request].append(self.free_pages.pop())
            locations.append(self.pages[request][position // self.page_size] * self.page_size + position % self.page_size)
        new = torch.tensor(locations, dtype=torch.int64)
        self.table.req_to_token[self.rows[request], start : start + count] = new.to(torch.int32).to(self.device)
        self.lens[request] += count
        return new.to(self.device)

    def decode_batch(self, requests: Sequence[int]) -> Any:
        """One decode step of ``requests`` (one new token each, its location written into the table
        as SGLang does before the forward), as an SGLang ``ForwardBatch``."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        out_cache_loc = torch.cat([self._grow(request, 1) for request in requests])
        seq_lens_cpu = torch.tensor([self.lens[request] for request in requests], dtype=torch.int64)
        rows_cpu = torch.tensor([self.rows[request] for request in requests], dtype=torch.int64)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(requests),
            input_ids=torch.zeros(len(requests), dtype=torch.int64, device=self.device),
            req_pool_indices=rows_cpu.to(self.device),
            seq_lens=seq_lens_cpu.to(self.device),
            out_cache_loc=out_cache_loc,
            seq_lens_sum=int(seq_lens_cpu.sum()),
            seq_lens_cpu=seq_lens_cpu,
            req_pool_indices_cpu=rows_cpu,
            positions=(seq_lens_cpu - 1).to(self.device),
        )

    def kv_snapshot(self) -> list[torch.Tensor]:
        """Every layer's K and V, copied."""
        return [buffer.clone() for buffer in (*self.kv.k_buffer, *self.kv.v_buffer)]

    def restore(self, snapshot: list[torch.Tensor]) -> None:
        for buffer, saved in zip((*self.kv.k_buffer, *self.kv.v_buffer), snapshot):
            buffer.copy_(saved)


class RunnerInputs:
    """SGLang's decode graph-runner inputs for captured sizes up to ``max_bs`` (module docstring).

    Args:
        device: the runner's device.
        max_bs: the largest captured batch.
        seq_len_fill_value: the attention backend's ``get_cuda_graph_seq_len_fill_value()``.
    """

    def __init__(self, device: str, max_bs: int, seq_len_fill_value: int) -> None:
        from sglang.srt.model_executor.cuda_graph_buffer_registry import build_decode_registry

        self.max_bs, self.fill = max_bs, seq_len_fill_value
        self.registry = build_decode_registry(
            device=torch.device(device), max_bs=max_bs, max_num_token=max_bs, seq_len_fill_value=seq_len_fill_value,
            cache_loc_dtype=torch.int64, register_global_num_tokens=False, share_pool=False,
        )

    def _slot(self, name: str, bs: int) -> torch.Tensor:
        return self.registry.get_slot(name).slice_for(bs, bs)

    def capture_batch(self, bs: int) -> Any:
        """The ``ForwardBatch`` SGLang captures size ``bs`` over (``capture_prepare`` after
        ``_capture``'s ``seq_lens.fill_(fill value)`` and ``reset_index_buffers()``)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        for name in ("seq_lens", "seq_lens_cpu"):
            self.registry.get_slot(name).buffer.fill_(self.fill)
        for name in ("req_pool_indices", "out_cache_loc", "positions"):
            self.registry.get_slot(name).buffer.zero_()
        seq_lens = self._slot("seq_lens", bs)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self._slot("input_ids", bs),
            req_pool_indices=self._slot("req_pool_indices", bs),
            seq_lens=seq_lens,
            seq_lens_cpu=self._slot("seq_lens_cpu", bs),
            orig_seq_lens=seq_lens,
            out_cache_loc=self._slot("out_cache_loc", bs),
            seq_lens_sum=int(seq_lens.sum().item()),
            positions=self._slot("positions", bs),
            can_run_decode_cuda_graph=True,
        )

    def buffers(self) -> SimpleNamespace:
        """The registry's buffers under the names ``build_replay_fb_view`` reads (``DecodeInputBuffers``')."""
        return SimpleNamespace(
            **{name: self.registry.get_slot(name).buffer for name in (
                "input_ids", "positions", "req_pool_indices", "seq_lens", "seq_lens_cpu")},
            encoder_lens=None, mamba_track_indices=None,
        )

    def replay_view(self, forward_batch: Any, bs: int, *, sglang_builder: bool = True) -> Any:
        """What a replay of captured size ``bs`` hands the backend for ``forward_batch``: SGLang's
        ``fill_from`` into the registry (padding the tail), then the replay view.

        Args:
            sglang_builder: build the view with SGLang's ``build_replay_fb_view``; ``False``: with
                ``replica_replay_view`` (the GPU machine cannot import SGLang's graph-runner module:
                its imports reach the ``openai`` client, whose dependencies do not travel there).
        """
        raw_bs = forward_batch.batch_size
        self.registry.fill_from(forward_batch, raw_bs=raw_bs, padded_bs=bs, raw_num_tokens=raw_bs, padded_num_tokens=bs)
        buffers = self.buffers()
        if not sglang_builder:
            return replica_replay_view(forward_batch, buffers, bs, self.fill)
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view

        return build_replay_fb_view(
            forward_batch=forward_batch, buffers=buffers, bs=bs, raw_bs=raw_bs, num_tokens=bs,
            global_num_tokens_cpu=None, seq_len_fill_value=self.fill, capture_forward_mode=ForwardMode.DECODE,
            is_encoder_decoder=False,
        )


#: the replay-view fields ``replica_replay_view`` builds, as SGLang 0.5.23's ``build_replay_fb_view``
REPLICA_FIELDS = (
    "batch_size", "forward_mode", "actual_forward_mode", "input_ids", "positions", "req_pool_indices", "seq_lens",
    "seq_lens_sum", "seq_lens_cpu", "num_padding", "out_cache_loc", "spec_info",
)


def replica_replay_view(forward_batch: Any, buffers: Any, bs: int, fill: int) -> SimpleNamespace:
    """SGLang 0.5.23's ``build_replay_fb_view`` for a plain decode batch, field for field over
    ``REPLICA_FIELDS`` (``test_sglang_graphs.py`` checks that both build the same view)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    raw_bs = forward_batch.batch_size
    return SimpleNamespace(
        batch_size=bs,
        forward_mode=ForwardMode.DECODE,
        actual_forward_mode=forward_batch.forward_mode,
        input_ids=buffers.input_ids[:bs],
        positions=buffers.positions[:bs],
        req_pool_indices=buffers.req_pool_indices[:bs],
        seq_lens=buffers.seq_lens[:bs],
        seq_lens_sum=None if forward_batch.seq_lens_sum is None else forward_batch.seq_lens_sum + (bs - raw_bs) * fill,
        seq_lens_cpu=None if forward_batch.seq_lens_cpu is None else buffers.seq_lens_cpu[:bs],
        num_padding=bs - raw_bs,
        out_cache_loc=forward_batch.out_cache_loc,
        spec_info=forward_batch.spec_info,
    )
