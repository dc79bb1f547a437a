"""Decode-step latency of a model-shaped stack, eager vs CUDA graph (kvplug bench graphs).

The stack is Qwen3-0.6B-shaped by default (28 layers, 16 query / 8 KV heads of 128, hidden
1024) with random weights; each step embeds tokens gathered from a device token pool, runs every
layer's attention through the chosen kvplug backend, and projects to logits. Eager steps include
the host work a real engine does per step (``build_attention_batch`` + ``prepare_metadata``);
graph steps include the runner's input copy and ``prepare_for_replay``. Latency is wall time per
step with the device synchronised, median over steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

SUITE = "graphs"
REQUIRES_CUDA = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", default="triton,flashinfer")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--context", type=int, default=1024, help="tokens already cached per request")
    parser.add_argument("--qo-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)


class DecoderStack:
    """Embedding -> layers of (qkv projection, kvplug attention, output projection) -> logits."""

    def __init__(self, backend: Any, token_pool: torch.Tensor, args: argparse.Namespace, vocab: int = 32_000) -> None:
        device, dtype = token_pool.device, torch.bfloat16
        self.backend, self.token_pool, self.layers = backend, token_pool, args.layers
        self.q_size, self.kv_size = args.qo_heads * args.head_dim, args.kv_heads * args.head_dim
        scale = args.hidden**-0.5
        self.embed = torch.randn(vocab, args.hidden, device=device, dtype=dtype)
        self.qkv = [torch.randn(args.hidden, self.q_size + 2 * self.kv_size, device=device, dtype=dtype) * scale
                    for _ in range(args.layers)]
        self.proj = [torch.randn(self.q_size, args.hidden, device=device, dtype=dtype) * self.q_size**-0.5
                     for _ in range(args.layers)]
        self.head = torch.randn(args.hidden, vocab, device=device, dtype=dtype) * scale

    def __call__(self, batch: Any) -> torch.Tensor:
        x = self.embed[self.token_pool[batch.table_rows.long(), batch.positions.long()].long()]
        for layer in range(self.layers):
            q, k, v = (x @ self.qkv[layer]).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            x = x + self.backend.forward(q, k, v, layer, batch) @ self.proj[layer]
        return x @ self.head


def _latency_us(step: Any, steps: int) -> float:
    samples = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= 3:
            samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def bench_backend(name: str, args: argparse.Namespace, sizes: list[int]) -> list[dict[str, Any]]:
    import kvplug
    from kvplug.attention.batch import build_attention_batch
    from kvplug.attention.graph_runner import GraphRunner
    from kvplug.interface import AttentionConfig, ForwardPhase, KVPoolConfig

    device, max_bs, ctx, page = torch.device("cuda"), max(sizes), args.context + 1, args.page_size
    pages_per_req = -(-ctx // page)
    pool = kvplug.create_kv_pool("mha", KVPoolConfig(args.layers, args.kv_heads, args.head_dim, max_bs * pages_per_req,
                                                     page, torch.bfloat16, device, options={"validate": False}))
    pool.kv_buffer.normal_()
    width = -(-ctx // 32) * 32
    table = torch.zeros(max_bs + 1, max(width, pages_per_req * page), dtype=torch.int32, device=device)
    order = torch.randperm(max_bs * pages_per_req, device=device).view(max_bs, pages_per_req, 1)
    table[:max_bs, : pages_per_req * page] = (order * page + torch.arange(page, device=device)).view(max_bs, -1).to(torch.int32)
    table[max_bs] = pool.num_pages * page
    token_pool = torch.randint(0, 32_000, table.shape, dtype=torch.int32, device=device)
    backend = kvplug.create_attention_backend(
        name, AttentionConfig(pool, table, args.qo_heads, args.kv_heads, args.head_dim)
    )
    model = DecoderStack(backend, token_pool, args)
    runner = GraphRunner(backend, table, model, max_batch_size=max_bs, max_seq_len=ctx, batch_sizes=sizes)
    start = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - start
    rows = []
    for bs in sizes:
        live, cached, lens = list(range(bs)), [args.context] * bs, [ctx] * bs

        def eager() -> torch.Tensor:
            batch = build_attention_batch(table, live, cached, lens, ForwardPhase.DECODE)
            backend.prepare_metadata(batch)
            return model(batch)

        eager_us = _latency_us(eager, args.steps)
        graph_us = _latency_us(lambda: runner.replay(live, cached, lens), args.steps)
        rows.append({"backend": name, "bs": bs, "eager_us": round(eager_us, 1), "graph_us": round(graph_us, 1),
                     "speedup": round(eager_us / graph_us, 2), "capture_s": round(capture_s, 2)})
    runner.teardown()
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise RuntimeError("kvplug bench graphs needs a CUDA device")
    if getattr(args, "quick", False):
        args.batch_sizes, args.layers, args.steps = "1,8", 4, 5
    sizes = sorted(int(b) for b in args.batch_sizes.split(","))
    rows = []
    for name in filter(None, args.backends.split(",")):
        rows += bench_backend(name, args, sizes)
        torch.cuda.empty_cache()
    keys = list(rows[0])
    print("  ".join(f"{k:>10}" for k in keys))
    for row in rows:
        print("  ".join(f"{row[k]!s:>10}" for k in keys))
    return {"decode_step": rows}
