"""Decode attention, store_kv and host-side metadata on one GPU, side by side with FlashInfer.

Everything is compared side by side in one run: each backend against FlashInfer called directly
on the same pool and page table, and bandwidths against a device-to-device copy measured in the
same process. Device times are CUDA events over back-to-back calls after warm-up (median of
repeats); each call reads a different layer so that K/V never sit in L2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Callable

import torch

from kvplug.bench.attention_host import bench_host_ops, bench_metadata
from kvplug.bench.device_timing import check_bars, copy_bandwidth, graph_times_us, interleaved_device_times
from kvplug.bench.timing import format_table

SUITE = "attention"
REQUIRES_CUDA = True
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", default="flashinfer,triton", help="comma-separated kvplug backends")
    parser.add_argument("--shapes", default="1x1024,64x2048,256x2048,128x8192", help="decode batch x context")
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--qo-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (median reported)")
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per timed repeat")
    parser.add_argument("--store-tokens", type=int, default=16384)
    parser.add_argument("--metadata-batch-sizes", default="1,64,256")
    parser.add_argument(
        "--triton-configs", default="", help="extra triton decode configs BLOCK_N:WARPS:STAGES,... to compare"
    )


class DecodeSetup:
    """A pool and page table holding ``bs`` requests of ``ctx`` tokens on random pages, with as many
    layers as it takes to exceed the L2 cache several times."""

    def __init__(self, args: argparse.Namespace, bs: int, ctx: int, page_size: int) -> None:
        import kvplug
        from kvplug.attention.batch import build_attention_batch
        from kvplug.interface import AttentionConfig, ForwardPhase, KVPoolConfig

        dtype, device = DTYPES[args.dtype], torch.device("cuda")
        per_layer = 2 * bs * ctx * args.kv_heads * args.head_dim * dtype.itemsize
        self.num_layers = max(1, min(64, math.ceil((512 << 20) / per_layer)))
        pages_per_req = math.ceil(ctx / page_size)
        num_pages = bs * pages_per_req + 1
        self.pool = kvplug.create_kv_pool(
            "mha",
            KVPoolConfig(self.num_layers, args.kv_heads, args.head_dim, num_pages, page_size, dtype, device,
                         options={"validate": False}),
        )
        self.pool.kv_buffer.normal_()
        width = math.ceil(ctx / 32) * 32
        table = torch.zeros(bs + 1, max(width, pages_per_req * page_size), dtype=torch.int32, device=device)
        pages = torch.randperm(num_pages, device=device)[: bs * pages_per_req].view(bs, pages_per_req, 1)
        offsets = torch.arange(page_size, device=device, dtype=torch.int32)
        table[:bs, : pages_per_req * page_size] = (pages * page_size + offsets).view(bs, -1).to(torch.int32)
        table[bs] = num_pages * page_size
        self.page_table = table
        self.batch = build_attention_batch(table, list(range(bs)), [ctx - 1] * bs, [ctx] * bs, ForwardPhase.DECODE)
        self.q = torch.randn(bs, args.qo_heads, args.head_dim, dtype=dtype, device=device)
        self.k = torch.randn(bs, args.kv_heads, args.head_dim, dtype=dtype, device=device)
        self.v = torch.randn_like(self.k)
        self.kv_bytes = per_layer
        self.config = lambda **options: AttentionConfig(
            self.pool, table, args.qo_heads, args.kv_heads, args.head_dim, options=options
        )


def direct_flashinfer(setup: DecodeSetup, args: argparse.Namespace, page_size: int) -> Callable[[int], Any]:
    """FlashInfer's decode wrapper planned and run by hand on the same pool (token view for page
    size 1, page view otherwise), the way a host would call it without kvplug."""
    import flashinfer

    bs, ctx = setup.q.shape[0], int(setup.batch.device_lens_cpu[0])
    rows = setup.page_table[:bs]
    if page_size == 1:
        indices = rows[:, :ctx].reshape(-1).contiguous()
        indptr = torch.arange(0, (bs + 1) * ctx, ctx, dtype=torch.int32)
        last = torch.ones(bs, dtype=torch.int32)
    else:
        pages = math.ceil(ctx / page_size)
        indices = (rows[:, ::page_size][:, :pages] // page_size).reshape(-1).contiguous()
        indptr = torch.arange(0, (bs + 1) * pages, pages, dtype=torch.int32)
        last = torch.full((bs,), ctx - (pages - 1) * page_size, dtype=torch.int32)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=args.qo_heads // args.kv_heads >= 4
    )
    dtype = setup.pool.dtype
    wrapper.plan(indptr, indices, last, args.qo_heads, args.kv_heads, args.head_dim, page_size,
                 q_data_type=dtype, kv_data_type=dtype)
    shape = (-1, page_size, args.kv_heads, args.head_dim)
    caches = [(setup.pool.k_cache(i).view(shape), setup.pool.v_cache(i).view(shape)) for i in range(setup.num_layers)]
    return lambda i: wrapper.run(setup.q, caches[i % setup.num_layers])


def bench_decode(args: argparse.Namespace, bandwidth: float) -> list[dict[str, Any]]:
    import kvplug

    rows = []
    backends = [(name, {}) for name in args.backends.split(",") if name]
    for spec in filter(None, args.triton_configs.split(",")):
        block_n, warps, stages = (int(x) for x in spec.split(":"))
        options = {"decode_block_n": block_n, "decode_num_warps": warps, "decode_num_stages": stages}
        backends.append((f"triton[{spec}]", options))
    for page_size in (int(p) for p in args.page_sizes.split(",")):
        for shape in args.shapes.split(","):
            bs, ctx = (int(x) for x in shape.split("x"))
            setup = DecodeSetup(args, bs, ctx, page_size)
            layers = setup.num_layers
            # the same direct call twice, from two wrappers: how far apart two identical calls time
            # (the noise floor every ratio below sits on)
            calls = {"flashinfer-direct": direct_flashinfer(setup, args, page_size),
                     "flashinfer-direct-again": direct_flashinfer(setup, args, page_size)}
            for label, options in backends:
                backend = kvplug.create_attention_backend(label.split("[")[0], setup.config(**options))
                batch = dataclasses.replace(setup.batch)  # each backend keeps its own metadata
                backend.prepare_metadata(batch)
                calls[label] = lambda i, b=backend, m=batch, s=setup: b._attend(s.q, i % layers, m)
                calls[f"{label}+store"] = lambda i, b=backend, m=batch, s=setup: b.forward(s.q, s.k, s.v, i % layers, m)
            eager = interleaved_device_times(calls, args.calls, args.repeats)
            graph = graph_times_us(calls, args)
            for label in calls:
                tbps = setup.kv_bytes / (graph[label] * 1e-6) / 1e12
                rows.append({"page": page_size, "bs": bs, "ctx": ctx, "impl": label,
                             "eager_us": round(eager[label], 1), "graph_us": round(graph[label], 2),
                             "TB/s": round(tbps, 3), "of_copy": round(tbps * 1e12 / bandwidth, 3),
                             "vs_fi_direct": round(graph["flashinfer-direct"] / graph[label], 3),
                             "vs_fi_direct_eager": round(eager["flashinfer-direct"] / eager[label], 3)})
            del setup
            torch.cuda.empty_cache()
    return rows


def bench_store(args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    from kvplug.kernels.store_kv import store_kv_triton

    n, heads, dim, dtype = args.store_tokens, args.kv_heads, args.head_dim, DTYPES[args.dtype]
    sets, locations = 8, 8 * args.store_tokens
    caches = [torch.zeros(locations, heads, dim, dtype=dtype, device="cuda") for _ in range(2 * sets)]
    k = [torch.randn(n, heads, dim, dtype=dtype, device="cuda") for _ in range(sets)]
    # distinct V sources: storing one tensor as both K and V would read it from L2 the second time
    v = [torch.randn(n, heads, dim, dtype=dtype, device="cuda") for _ in range(sets)]
    loc = [torch.randperm(locations, device="cuda")[:n].to(torch.int32) for _ in range(sets)]
    moved = 2 * 2 * n * heads * dim * dtype.itemsize  # K and V, read + written

    def torch_store(i: int) -> None:
        caches[2 * (i % sets)][loc[i % sets]] = k[i % sets]
        caches[2 * (i % sets) + 1][loc[i % sets]] = v[i % sets]

    calls = {
        "triton": lambda i: store_kv_triton(
            caches[2 * (i % sets)], caches[2 * (i % sets) + 1], loc[i % sets], k[i % sets], v[i % sets]
        ),
        "torch_index": torch_store,
    }
    # eager back-to-back calls are launch-bound on a slow host (a Triton launch can cost more host
    # time than the 16k-token store takes on the device): the graph figure is the kernel's
    eager = interleaved_device_times(calls, args.calls, args.repeats)
    graph = graph_times_us(calls, args)
    result: dict[str, Any] = {"tokens": n}
    for name in calls:
        result[f"{name}_us"] = round(graph[name], 2)
        result[f"{name}_eager_us"] = round(eager[name], 2)
        result[f"{name}_TB/s"] = round(moved / (graph[name] * 1e-6) / 1e12, 3)
        result[f"{name}_of_copy"] = round(moved / (graph[name] * 1e-6) / bandwidth, 3)
        result[f"{name}_eager_of_copy"] = round(moved / (eager[name] * 1e-6) / bandwidth, 3)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise RuntimeError("kvplug bench attention needs a CUDA device")
    if getattr(args, "quick", False):
        args.shapes, args.page_sizes, args.repeats, args.calls = "1x1024,64x2048", "16", 3, 5
        args.store_tokens, args.metadata_batch_sizes = 4096, "1,256"
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"device-to-device copy: {bandwidth / 1e12:.3f} TB/s (read + write)")
    store = bench_store(args, bandwidth)
    print("store_kv:", store)
    host_ops = bench_host_ops()
    print("host cost of primitive ops (us):\n" + format_table(host_ops, list(host_ops[0])))
    metadata = bench_metadata(args)
    print("host metadata per decode step (us):\n" + format_table(metadata, list(metadata[0])))
    decode = bench_decode(args, bandwidth)
    print("decode attention:\n" + format_table(decode, list(decode[0])))
    bars = check_bars(store, metadata, decode)
    for bar in bars:
        print(f"{bar['bar']}: {bar['worst']} ({bar['where']}) -> {'met' if bar['met'] else 'NOT met'}")
    return {"copy_TB/s": round(bandwidth / 1e12, 3), "store_kv": store, "host_ops": host_ops, "metadata": metadata,
            "decode": decode, "bars": bars}
