"""Decode-step latency of a model-shaped stack through ``KVBackend``, eager vs CUDA graph
(kvplug bench graphs).

The stack is Qwen3-0.6B-shaped by default (28 layers, 16 query / 8 KV heads of 128, hidden
1024) with random weights; each step embeds the step's input ids, runs every layer's attention
through the chosen kvplug backend, and projects to logits. Two backends of the same sizes hold
the same requests (``--context`` cached tokens each): one steps eagerly
(``begin_decode`` -> forward -> ``commit``), the other through ``decode_graphs``
(``begin_decode`` -> ``graphs.run`` -> ``commit``), so both figures include the host work a real
engine does per step. Latency is wall time per step with the device synchronised, median over
steps.
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

    def __init__(self, backend: Any, args: argparse.Namespace, vocab: int = 32_000) -> None:
        device, dtype = backend.device, torch.bfloat16
        self.backend, self.layers = backend, args.layers
        self.q_size, self.kv_size = args.qo_heads * args.head_dim, args.kv_heads * args.head_dim
        scale = args.hidden**-0.5
        gen = torch.Generator(device=device).manual_seed(0)
        self.embed = torch.randn(vocab, args.hidden, device=device, dtype=dtype, generator=gen)
        self.qkv = [torch.randn(args.hidden, self.q_size + 2 * self.kv_size, device=device, dtype=dtype, generator=gen)
                    * scale for _ in range(args.layers)]
        self.proj = [torch.randn(self.q_size, args.hidden, device=device, dtype=dtype, generator=gen)
                     * self.q_size**-0.5 for _ in range(args.layers)]
        self.head = torch.randn(args.hidden, vocab, device=device, dtype=dtype, generator=gen) * scale

    def __call__(self, step: Any) -> torch.Tensor:
        x = self.embed[step.input_ids.long()]
        for layer in range(self.layers):
            q, k, v = (x @ self.qkv[layer]).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            x = x + self.backend.forward(q, k, v, layer, step.batch) @ self.proj[layer]
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


def _backend_with_requests(name: str, args: argparse.Namespace, max_bs: int, max_seq_len: int) -> tuple:
    """A backend holding ``max_bs`` requests of ``--context`` cached tokens each (their K/V are
    not computed: the timings do not depend on the values), with one known token to decode."""
    import kvplug
    from kvplug.memory.model_shape import ModelShape

    shape = ModelShape(args.layers, args.qo_heads, args.kv_heads, args.head_dim, torch.bfloat16)
    pages = max_bs * -(-max_seq_len // args.page_size) + 1
    backend = kvplug.create_backend(shape, page_size=args.page_size, num_pages=pages, max_running_reqs=max_bs,
                                    max_seq_len=max_seq_len, prefix_cache="naive", attention=name, device="cuda")
    gen = torch.Generator().manual_seed(1)
    requests = [backend.admit(torch.randint(0, 32_000, (args.context,), generator=gen)) for _ in range(max_bs)]
    backend.allocate(requests)
    backend.prepare(requests, "prefill")
    backend.append_tokens(requests, torch.ones(max_bs, dtype=torch.int32, device="cuda"))
    return backend, requests, DecoderStack(backend, args)


def bench_backend(name: str, args: argparse.Namespace, sizes: list[int]) -> list[dict[str, Any]]:
    max_bs = max(sizes)
    max_seq_len = args.context + len(sizes) * (args.steps + 3) + 8
    eager_backend, eager_requests, eager_model = _backend_with_requests(name, args, max_bs, max_seq_len)
    graph_backend, graph_requests, graph_model = _backend_with_requests(name, args, max_bs, max_seq_len)
    start = time.perf_counter()
    graphs = graph_backend.decode_graphs(graph_model, batch_sizes=sizes)
    capture_s = time.perf_counter() - start
    sampled = torch.ones(max_bs, dtype=torch.int32, device="cuda")
    rows = []
    for bs in sizes:
        def eager() -> None:
            step = eager_backend.begin_decode(eager_requests[:bs])
            eager_model(step)
            step.commit(sampled[:bs])

        def replayed() -> None:
            step = graph_backend.begin_decode(graph_requests[:bs])
            graphs.run(step)
            step.commit(sampled[:bs])

        eager_us = _latency_us(eager, args.steps)
        graph_us = _latency_us(replayed, args.steps)
        rows.append({"backend": name, "bs": bs, "eager_us": round(eager_us, 1), "graph_us": round(graph_us, 1),
                     "speedup": round(eager_us / graph_us, 2), "capture_s": round(capture_s, 2),
                     "capture_mib": round(graphs.capture_bytes / 2**20, 1)})
    graphs.release()
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
