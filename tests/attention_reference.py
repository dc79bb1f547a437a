"""Shared by the attention tests: a random batch factory over a real ``mha`` pool and a dense
SDPA oracle that never looks at the pool or the page table.

A case scatters each request's pages at random over the pool (non-contiguous, shuffled), fills the
whole pool with random K/V (so reading a wrong location gives a wrong answer), fills unused table
cells with random valid locations (so reading past a request's length gives a wrong answer too),
and keeps a dense copy of every request's K/V for the oracle.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Sequence

import pytest
import torch
import torch.nn.functional as F

import kvplug
from kvplug.attention.batch import build_attention_batch
from kvplug.interface import AttentionBatch, AttentionConfig, ForwardPhase, KVPoolConfig

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def importable(module: str) -> bool:
    """Whether ``module`` imports here (optional GPU libraries: triton, flashinfer, sgl_kernel)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny CPU ops run far faster on one intra-op thread than on two contended ones (15 ms vs
    0.1 ms per einsum seen on the 2-core CI machine); import this into a test module to apply it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass
class AttentionCase:
    """One randomised step: pool, table, batch, new q/k/v and the dense per-request K/V."""

    pool: kvplug.BaseKVPool
    page_table: torch.Tensor
    batch: AttentionBatch
    q: torch.Tensor  # [num_tokens, num_qo_heads, head_dim], pool dtype, pool device
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor
    layer_id: int
    lens: list[tuple[int, int]]
    rows: list[int]
    dense_k: list[torch.Tensor] = field(default_factory=list)  # per request [device_len, H, D], cpu
    dense_v: list[torch.Tensor] = field(default_factory=list)
    num_qo_heads: int = 0
    scale: float | None = None

    def config(self, **options) -> AttentionConfig:
        return AttentionConfig(
            pool=self.pool,
            page_table=self.page_table,
            num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.pool.local_kv_heads,
            head_dim=self.pool.head_dim,
            scale=self.scale,
            options=options,
        )

    def expected_pool(self) -> torch.Tensor:
        """The pool buffer as it must look after ``forward`` stored this step's K/V."""
        expected = self.pool.kv_buffer.clone()
        shape = (-1, self.pool.local_kv_heads, self.pool.head_dim)
        locations = self.batch.out_loc.long()
        expected[0, self.layer_id].view(shape)[locations] = self.k
        expected[1, self.layer_id].view(shape)[locations] = self.v
        return expected


def make_case(
    lens: Sequence[tuple[int, int]],
    *,
    page_size: int = 1,
    num_qo_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    phase: ForwardPhase | None = None,
    seed: int = 0,
    num_layers: int = 2,
    layer_id: int = 1,
    spare_pages: int = 3,
    scale: float | None = None,
) -> AttentionCase:
    """Build a random case; ``lens`` holds ``(cached_len, device_len)`` per request."""
    gen = torch.Generator().manual_seed(seed)
    bs = len(lens)
    if phase is None:
        phase = ForwardPhase.DECODE if all(d - c == 1 for c, d in lens) else ForwardPhase.PREFILL
    pages_per_req = [-(-d // page_size) for _, d in lens]
    num_pages = sum(pages_per_req) + spare_pages
    pool = kvplug.create_kv_pool(
        "mha",
        KVPoolConfig(num_layers, num_kv_heads, head_dim, num_pages, page_size, dtype, torch.device(device)),
    )
    if pool.device.type == "cuda":  # generating a large pool on the host would dominate GPU test time
        device_gen = torch.Generator(device=pool.device).manual_seed(seed)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=device_gen, device=pool.device))
    else:
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(dtype))
    num_locations = num_pages * page_size
    max_running_reqs = max(2 * bs, 4)
    width = align_up(max(d for _, d in lens), 32)
    table = torch.randint(0, num_locations, (max_running_reqs + 1, width), generator=gen, dtype=torch.int32)
    table[-1] = num_locations  # the dummy request points at the dummy page
    rows = torch.randperm(max_running_reqs, generator=gen)[:bs].tolist()
    page_order = torch.randperm(num_pages, generator=gen)
    offsets = torch.arange(page_size)
    taken = 0
    for row, n_pages in zip(rows, pages_per_req):
        pages = page_order[taken : taken + n_pages]
        taken += n_pages
        locations = (pages[:, None] * page_size + offsets).flatten().to(torch.int32)
        filled = min(width, n_pages * page_size)  # a row ends at its width even mid-page
        table[row, :filled] = locations[:filled]
    page_table = table.to(device)

    num_tokens = sum(d - c for c, d in lens)
    q = torch.randn(num_tokens, num_qo_heads, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    batch = build_attention_batch(
        page_table, rows, [c for c, _ in lens], [d for _, d in lens], phase
    )
    case = AttentionCase(pool, page_table, batch, q, k, v, layer_id, list(lens), rows, num_qo_heads=num_qo_heads, scale=scale)
    k_flat = pool.k_cache(layer_id).reshape(-1, num_kv_heads, head_dim)
    v_flat = pool.v_cache(layer_id).reshape(-1, num_kv_heads, head_dim)
    start = 0
    for row, (cached, total) in zip(rows, lens):
        prefix = table[row, :cached].long().to(device)
        stop = start + total - cached
        case.dense_k.append(torch.cat([k_flat[prefix], k[start:stop]]))
        case.dense_v.append(torch.cat([v_flat[prefix], v[start:stop]]))
        start = stop
    return case


def dense_attention(
    q: torch.Tensor, dense_k: Sequence[torch.Tensor], dense_v: Sequence[torch.Tensor], lens, scale: float | None = None
) -> torch.Tensor:
    """The oracle: float64 SDPA per request (on q's device: the GPU's float64 keeps long cases
    fast), causal aligned to the end of each request.

    Args:
        q: shape ``[num_tokens, num_qo_heads, head_dim]``, any float dtype, any device.
        dense_k, dense_v: per request ``[device_len, num_kv_heads, head_dim]``, q's device.
        lens: ``(cached_len, device_len)`` per request.

    Returns shape ``[num_tokens, num_qo_heads, head_dim]``, float64, cpu.
    """
    q = q.detach().to(torch.float64)
    outs, start = [], 0
    for keys, values, (cached, total) in zip(dense_k, dense_v, lens):
        n = total - cached
        group = q.shape[1] // keys.shape[1]
        qi = q[start : start + n].transpose(0, 1)  # [H, n, D]
        ki = keys.to(torch.float64).repeat_interleave(group, dim=1).transpose(0, 1)
        vi = values.to(torch.float64).repeat_interleave(group, dim=1).transpose(0, 1)
        positions = torch.arange(total, device=q.device)
        mask = positions[None, :] <= positions[cached:, None]
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs).cpu()


def case_reference(case: AttentionCase) -> torch.Tensor:
    return dense_attention(case.q, case.dense_k, case.dense_v, case.lens, case.scale)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64 (NaN anywhere gives NaN, which fails every bound)."""
    out64 = out.detach().to("cpu", torch.float64).reshape(ref.shape)
    return float((out64 - ref).norm() / ref.norm())


def run_case(backend_name: str, case: AttentionCase, **options) -> torch.Tensor:
    """Build the backend by name over the case's pool, plan, run one layer; returns
    ``[num_tokens, num_qo_heads, head_dim]``."""
    backend = kvplug.create_attention_backend(backend_name, case.config(**options))
    backend.prepare_metadata(case.batch)
    out = backend.forward(case.q, case.k, case.v, case.layer_id, case.batch)
    return out.view(case.q.shape)


# Scenario name -> (cached_len, device_len) per request. Lengths straddle page boundaries of 16 and 64.
SCENARIOS: dict[str, list[tuple[int, int]]] = {
    "decode": [(0, 1), (15, 16), (16, 17), (63, 64), (130, 131), (400, 401)],
    "extend_with_prefix": [(0, 37), (1, 20), (16, 33), (17, 18), (64, 100), (100, 165)],
    "mixed_short_long": [(0, 3), (31, 32), (0, 130), (300, 330), (500, 501), (5, 6)],
}

# Long contexts for the GPU backends: many KV splits per request, and a long extend.
LONG_SCENARIOS: dict[str, list[tuple[int, int]]] = {
    "long_decode": [(8191, 8192), (2047, 2048), (0, 1), (4000, 4001), (1023, 1024)],
    "long_extend": [(3000, 3300), (0, 1000), (4095, 4096)],
}


def chunk_lens(total: int, chunk: int) -> list[tuple[int, int]]:
    """``(cached_len, device_len)`` of each chunk when prefilling ``total`` tokens ``chunk`` at a time."""
    return [(start, min(start + chunk, total)) for start in range(0, total, chunk)]


class ModelStack:
    """A decoder-shaped stack for the CUDA-graph tests: token embedding gathered on the device
    from a token pool, ``num_layers`` of (qkv projection -> backend attention -> output
    projection + residual), then a logits head. ``__call__(batch)`` is a host's decode step.

    Weights depend only on ``seed``, so two stacks over two pools compute the same function.
    """

    def __init__(self, backend, token_pool, *, num_layers, num_qo_heads, num_kv_heads, head_dim,
                 hidden=256, vocab=512, dtype=torch.float32, device="cpu", seed=0):
        gen = torch.Generator().manual_seed(seed)

        def weight(*shape):
            return (torch.randn(*shape, generator=gen) / shape[0] ** 0.5).to(dtype).to(device)

        self.backend, self.token_pool = backend, token_pool
        self.num_layers = num_layers
        self.q_size, self.kv_size = num_qo_heads * head_dim, num_kv_heads * head_dim
        self.embed = weight(vocab, hidden) * hidden**0.5
        self.qkv = [weight(hidden, self.q_size + 2 * self.kv_size) for _ in range(num_layers)]
        self.proj = [weight(self.q_size, hidden) for _ in range(num_layers)]
        self.head = weight(hidden, vocab)

    def __call__(self, batch) -> torch.Tensor:
        rows = batch.table_rows.long()
        if not batch.is_decode:  # one row per new token (a sync, fine outside graphs)
            rows = rows.repeat_interleave((batch.extend_start[1:] - batch.extend_start[:-1]).long())
        ids = self.token_pool[rows, batch.positions.long()]
        x = self.embed[ids.long()]
        for layer in range(self.num_layers):
            q, k, v = (x @ self.qkv[layer]).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            attended = self.backend.forward(q, k, v, layer, batch)
            x = x + 0.5 * (attended @ self.proj[layer])
        return (x @ self.head).float()


def make_decode_world(*, backend_name, num_layers, page_size, max_reqs, max_seq_len, num_qo_heads=4,
                      num_kv_heads=2, head_dim=64, dtype=torch.float32, device="cpu", seed=0, **options):
    """Pool, page table (every request row fully mapped to random pages; last row dummy), a random
    token pool, the backend and a ``ModelStack`` over them. Identical for identical arguments."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_row = -(-max_seq_len // page_size)
    num_pages = max_reqs * pages_per_row + 2
    pool = kvplug.create_kv_pool(
        "mha", KVPoolConfig(num_layers, num_kv_heads, head_dim, num_pages, page_size, dtype, torch.device(device))
    )
    width = align_up(max_seq_len, 32)
    table = torch.zeros(max_reqs + 1, width, dtype=torch.int32)
    order = torch.randperm(num_pages, generator=gen)[: max_reqs * pages_per_row].view(max_reqs, pages_per_row, 1)
    locations = (order * page_size + torch.arange(page_size)).view(max_reqs, -1)[:, :width]
    table[:max_reqs, : locations.shape[1]] = locations.to(torch.int32)
    table[max_reqs] = num_pages * page_size
    page_table = table.to(device)
    token_pool = torch.randint(0, 512, (max_reqs + 1, width), generator=gen, dtype=torch.int32).to(device)
    config = AttentionConfig(pool, page_table, num_qo_heads, num_kv_heads, head_dim, options=options)
    backend = kvplug.create_attention_backend(backend_name, config)
    model = ModelStack(backend, token_pool, num_layers=num_layers, num_qo_heads=num_qo_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device, seed=seed)
    return pool, page_table, backend, model


def prefill_world(pool, page_table, backend, model, rows, lengths):
    """Run the model's prefill over ``lengths[i]`` tokens of each row (fills the pool's K/V)."""
    batch = build_attention_batch(page_table, rows, [0] * len(rows), lengths, ForwardPhase.PREFILL)
    backend.prepare_metadata(batch)
    return model(batch)
