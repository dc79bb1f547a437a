"""End-to-end serving through the transformers host, radix vs naive vs native.

A Qwen3-shaped model with random weights (built in-process, nothing downloaded) generates with
transformers' continuous batching (``generate_batch``) on kvplug with the ``radix`` and ``naive``
prefix caches and on transformers' own paged cache (``native``, its block sharing on), on three
workloads:

- ``shared-prefix``: requests = one of a few system prompts + a unique question, all submitted at
  once; one run per concurrency level (requests per step);
- ``no-prefix``: the same lengths, every token random: what radix costs when nothing hits (with
  long outputs, the decode-heavy workload);
- ``multi-turn``: chats growing turn by turn (prompt = previous prompt + answer + new question),
  one round per turn, one manager (one prefix cache) across the turns;
- ``long-context-chat`` (not in the default list; for the host-memory tier): multi-turn chats each
  over its own long context, with a pool ``--working-set-ratio`` (default 4) times smaller than the
  workload's working set; compare ``radix`` with ``radix+host`` (the tier, ``--host-memory``,
  default 1.25x the working set's KV bytes). With a ``+host`` variant the run also measures the
  tier's copy bandwidth against a plain pinned-memory copy of the same bytes. ``--turns 1`` makes
  it the tier's 0 %-hit case (every request evicts and writes back, nothing is reused).

Reported per run: requests/s, output and total (prompt + output) tokens/s over the serving time
(first submission to last finish), TTFT and per-request latency p50/p99 (from submission, so they
include queueing) and kvplug's prefix-cache hit rate. Variants alternate within each repeat and
figures are medians over repeats; ratios radix/naive and radix/native sit side by side.

Sizes: ``--device cuda`` defaults to the issue's sizes on ``qwen3-0.6b`` in bf16 (256 requests,
8 system prompts of 2,048 tokens, 256-token questions, 128 output tokens); CPU defaults to
``qwen3-tiny`` in fp32 at sizes that finish in minutes on 2 cores; ``--quick`` is a smoke run.
Every size has its own flag. The host runs the rounds: it is looked up by name through the plugin
manager (``--host``, default ``transformers``: ``pip install ./adapters/transformers``), so kvplug
imports no host package (``kvplug.bench.e2e_host``).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

from kvplug._version import __version__
from kvplug.bench.e2e_host import DEFAULT_HOST, BenchModel, E2EHost, find_e2e_host
from kvplug.bench.e2e_model import DEFAULT_SHAPE, MODEL_SHAPES, SEED, default_dtype, describe_shape
from kvplug.bench.e2e_runner import HOST_TIER_SUFFIX, NATIVE, RunConfig, parse_variant
from kvplug.bench.e2e_workloads import (
    PRESETS,
    TIER_WORKLOADS,
    WORKLOADS,
    E2ESizes,
    Workload,
    build_workload,
    working_set_tokens,
)
from kvplug.bench.tier_copy import measure_copy_bandwidth
from kvplug.memory.capacity import parse_memory_size
from kvplug.bench.timing import format_table
from kvplug.devices import resolve_device

SUITE = "e2e"
SCHEMA = 1
BASELINES = ("naive", NATIVE, "radix:eager", "radix:sync")
MEDIAN_FIELDS = ("serve_s", "wall_s", "req_per_s", "output_tok_per_s", "total_tok_per_s", "ttft_p50_ms",
                 "ttft_p99_ms", "latency_p50_ms", "latency_p99_ms")
# docs/design.md, section 9: radix >= 3x naive's throughput with shared prefixes, and costs < 2 % when nothing hits
BARS = {"shared-prefix": ("radix/naive throughput >= 3.0", 3.0), "no-prefix": ("radix/naive throughput >= 0.98", 0.98)}
# docs/design.md, section 7: the host tier on a working set ~4x the pool
TIER_BARS = (("throughput", "radix+host/radix throughput >= 2.0", lambda value: value >= 2.0),
             ("ttft_p50", "radix+host/radix TTFT p50 <= 0.5", lambda value: value <= 0.5))
TIER_OVERHEAD_BARS = (("throughput", "radix+host/radix throughput >= 0.98 at 0 % hits", lambda value: value >= 0.98),)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SIZE_FLAGS = ("requests", "system_prompts", "system_tokens", "question_tokens", "output_tokens",
              "conversations", "turns", "max_batch_tokens")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"the host plugin that runs the workloads (default {DEFAULT_HOST})")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default=None,
                        help="default: qwen3-0.6b on CUDA, qwen3-tiny on CPU")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--variants", default="radix,naive,native",
                        help="kvplug prefix caches by name (append ':eager' to turn kvplug's CUDA graphs off, "
                             "':sync' to turn transformers' async batching off, ':compile' to torch.compile the model "
                             "kvplug captures), "
                             "and 'native' for transformers' own cache")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"some of {','.join([*WORKLOADS, *TIER_WORKLOADS])} (default: {','.join(WORKLOADS)})")
    parser.add_argument("--working-set-ratio", default="4",
                        help="long-context-chat: the workload's working set over the pool; comma-separated for "
                             "one run per ratio (rows named long-context-chat@<ratio>x) (default 4)")
    parser.add_argument("--host-memory", default=None,
                        help="host-memory tier of '+host' variants, e.g. 32GiB (default: 1.25x the working set's KV)")
    parser.add_argument("--concurrency", default=None, help="comma-separated requests per step (shared-prefix levels)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--attention", default="auto", help="kvplug attention backend (default auto)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per variant, medians reported (default 3; quick 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    for name in SIZE_FLAGS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="overrides the preset")


def resolve_sizes(args: argparse.Namespace, device: torch.device) -> tuple[str, E2ESizes]:
    preset = "quick" if getattr(args, "quick", False) else ("gpu" if device.type == "cuda" else "cpu")
    concurrency = None
    if args.concurrency:
        concurrency = tuple(sorted({int(level) for level in args.concurrency.split(",") if level}))
    sizes = PRESETS[preset].updated(concurrency=concurrency, **{name: getattr(args, name) for name in SIZE_FLAGS})
    if min(sizes.concurrency) < 1 or min(getattr(sizes, name) for name in SIZE_FLAGS) < 1:
        raise ValueError(f"every size must be positive, got {sizes}")
    return preset, sizes


def run_config(sizes: E2ESizes, workload: Workload, concurrency: int, page_size: int, attention: str,
               *, working_set_ratio: float = 4.0, host_memory: int | None = None,
               kv_bytes_per_token: int | None = None) -> RunConfig:
    """A pool that holds ``concurrency`` requests of the longest length plus every distinct
    system prompt, so no variant is starved of memory: the cache policy is what differs.

    ``long-context-chat`` instead gets a pool ``working_set_ratio`` times smaller than its working
    set (at least one longest request), as many rows as that pool holds requests (at most
    ``concurrency``), and a host tier of ``host_memory`` bytes (default: 1.25x the working set's KV,
    from ``kv_bytes_per_token``)."""
    if workload.name in TIER_WORKLOADS:
        longest = sizes.system_tokens + sizes.chat_prompt_tokens + sizes.output_tokens
        pages_per_request = -(-longest // page_size)
        working = working_set_tokens(workload.name, sizes)
        num_pages = max(-(-int(working / working_set_ratio) // page_size), pages_per_request + 1)
        rows = max(1, min(concurrency, len(workload.first_round), num_pages // pages_per_request))
        if host_memory is None and kv_bytes_per_token is not None:
            host_memory = int(1.25 * working) * kv_bytes_per_token
        return RunConfig(concurrency=rows, page_size=page_size, num_pages=num_pages,
                         max_seq_len=pages_per_request * page_size, max_batch_tokens=sizes.max_batch_tokens,
                         output_tokens=sizes.output_tokens, attention=attention, host_memory=host_memory)
    pages_per_request = -(-sizes.longest_request // page_size)
    prefix_pages = sizes.system_prompts * -(-sizes.system_tokens // page_size)
    rows = min(concurrency, len(workload.first_round))
    if host_memory is None and kv_bytes_per_token is not None:  # '+host' variants here measure the tier's overhead
        host_memory = int(1.25 * max(working_set_tokens(workload.name, sizes), page_size)) * kv_bytes_per_token
    return RunConfig(concurrency=rows, page_size=page_size, num_pages=rows * pages_per_request + prefix_pages + 1,
                     max_seq_len=pages_per_request * page_size, max_batch_tokens=sizes.max_batch_tokens,
                     output_tokens=sizes.output_tokens, attention=attention, host_memory=host_memory)


def parse_ratios(text: str | float) -> list[float]:
    """``--working-set-ratio``: one positive number or a comma-separated list."""
    try:
        values = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"--working-set-ratio must be numbers like 4 or 1,2,4,8, got {text!r}") from error
    if not values or min(values) <= 0:
        raise ValueError(f"--working-set-ratio must be positive numbers, got {text!r}")
    return values


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    row = dict(runs[0])
    for name in MEDIAN_FIELDS:
        row[name] = round(statistics.median(run[name] for run in runs), 3)
    serve = [run["serve_s"] for run in runs]
    row["serve_s_spread"] = round((max(serve) - min(serve)) / statistics.median(serve), 4)
    row["repeats"] = len(runs)
    return row


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """radix over each baseline, per workload and concurrency: throughput (>1 is better) and
    TTFT p50 (<1 is better)."""
    by_key = {(row["workload"], row["concurrency"], row["variant"]): row for row in rows}
    result = []
    for (workload, concurrency, variant), row in by_key.items():
        if variant.endswith(HOST_TIER_SUFFIX):  # the tier over the same cache without it
            base = variant.removesuffix(HOST_TIER_SUFFIX)
            other = by_key.get((workload, concurrency, base))
            if other is not None:
                result.append({
                    "workload": workload, "concurrency": concurrency, "ratio": f"{variant}/{base}",
                    "throughput": round(row["output_tok_per_s"] / other["output_tok_per_s"], 3),
                    "ttft_p50": round(row["ttft_p50_ms"] / other["ttft_p50_ms"], 3),
                    "latency_p50": round(row["latency_p50_ms"] / other["latency_p50_ms"], 3),
                })
            continue
        if variant != "radix":
            continue
        for baseline in BASELINES:
            other = by_key.get((workload, concurrency, baseline))
            if other is None:
                continue
            result.append({
                "workload": workload, "concurrency": concurrency, "ratio": f"radix/{baseline}",
                "throughput": round(row["output_tok_per_s"] / other["output_tok_per_s"], 3),
                "ttft_p50": round(row["ttft_p50_ms"] / other["ttft_p50_ms"], 3),
                "latency_p50": round(row["latency_p50_ms"] / other["latency_p50_ms"], 3),
            })
    return result


def bars(ratio_rows: list[dict[str, Any]], at_issue_sizes: bool, *, tier_reuse: bool = True) -> list[dict[str, Any]]:
    """Verdicts on the targets of docs/design.md, section 9. ``tier_reuse=False`` (a one-turn
    long-context-chat: evictions and write-backs, nothing ever reused) checks the tier's 0 %-hit
    overhead instead of its gains."""
    verdicts = []
    for row in ratio_rows:
        if row["ratio"] == "radix+host/radix" and row["workload"] in ("long-context-chat", "long-context-chat@4x"):
            for field, text, met in (TIER_BARS if tier_reuse else TIER_OVERHEAD_BARS):
                verdicts.append({"workload": row["workload"], "concurrency": row["concurrency"], "bar": text,
                                 "measured": row[field], "met": met(row[field]), "at_issue_sizes": at_issue_sizes})
            continue
        bar = BARS.get(row["workload"])
        if bar is None or row["ratio"] != "radix/naive":
            continue
        verdicts.append({"workload": row["workload"], "concurrency": row["concurrency"], "bar": bar[0],
                         "measured": row["throughput"], "met": row["throughput"] >= bar[1],
                         "at_issue_sizes": at_issue_sizes})
    return verdicts


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    host = find_e2e_host(getattr(args, "host", DEFAULT_HOST))
    variants = [name for name in args.variants.split(",") if name]
    for variant in variants:
        parse_variant(variant)  # a bad name fails before the model is built
    device = resolve_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"), require_available=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = args.model_shape or DEFAULT_SHAPE[device.type if device.type in DEFAULT_SHAPE else "cpu"]
    dtype = DTYPES[args.dtype] if args.dtype else default_dtype(device)
    preset, sizes = resolve_sizes(args, device)
    repeats = args.repeats or (1 if preset == "quick" else 3)
    workload_names = [name for name in args.workloads.split(",") if name]
    started = time.perf_counter()
    model = host.build_model(shape, MODEL_SHAPES[shape], SEED, device, dtype)
    vocab = model.vocab_size
    workloads = [build_workload(name, sizes, vocab, args.seed) for name in workload_names]
    working_set_ratios = parse_ratios(args.working_set_ratio)
    # (workload, concurrency level, working-set ratio or None, the name its rows carry)
    plan = []
    for workload in workloads:
        if workload.name in TIER_WORKLOADS:
            multiple = len(working_set_ratios) > 1
            plan += [(workload, sizes.concurrency[-1], ratio, f"{workload.name}@{ratio:g}x" if multiple else workload.name)
                     for ratio in working_set_ratios]
        else:
            levels = sizes.concurrency if workload.name != "multi-turn" else sizes.concurrency[-1:]
            plan += [(workload, level, None, workload.name) for level in levels]
    kv_bytes_per_token = model.shape.kv_bytes_per_token()
    host_memory = parse_memory_size(args.host_memory) if args.host_memory else None
    tier_options = dict(working_set_ratio=working_set_ratios[0], host_memory=host_memory,
                        kv_bytes_per_token=kv_bytes_per_token)
    _warm_up(host, model, variants, sizes, args, tier_options, with_tier_workload=any(w.name in TIER_WORKLOADS for w in workloads))
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    total, done = len(plan) * repeats * len(variants), 0
    for workload, level, ratio, row_name in plan:
        config = run_config(sizes, workload, level, args.page_size, args.attention,
                            **{**tier_options, "working_set_ratio": ratio or working_set_ratios[0]})
        if ratio is not None:
            _progress(f"{row_name}: working set {working_set_tokens(workload.name, sizes):,} tokens, pool "
                      f"{config.num_pages * config.page_size:,} tokens, {config.concurrency} rows, host tier "
                      f"{(config.host_memory or 0) / 2**30:.2f} GiB")
        for repeat in range(repeats):
            # rotate the order each repeat so no variant always runs first (warmest / coldest caches)
            order = variants[repeat % len(variants):] + variants[: repeat % len(variants)]
            for variant in order:
                figures = host.run_variant(model, variant, config, workload)
                _release_pool(device)
                done += 1
                _progress(f"[{done}/{total}] {row_name} concurrency {config.concurrency} {variant} "
                          f"repeat {repeat + 1}: {figures['serve_s']:.2f} s, {figures['output_tok_per_s']:.1f} out tok/s")
                row = {"workload": row_name, "concurrency": config.concurrency, "variant": variant, **figures}
                if ratio is not None:
                    row.update(working_set_ratio=ratio, pool_tokens=config.num_pages * config.page_size)
                runs.setdefault((row_name, config.concurrency, variant), []).append(row)
    rows = [_median_row(group) for group in runs.values()]
    ratio_rows = ratios(rows)
    issue = PRESETS["gpu"]
    at_issue_sizes = shape == "qwen3-0.6b" and all(
        getattr(sizes, name) == getattr(issue, name)
        for name in ("requests", "system_prompts", "system_tokens", "question_tokens", "output_tokens")
    )
    verdicts = bars(ratio_rows, at_issue_sizes=at_issue_sizes, tier_reuse=sizes.turns > 1)
    columns = ["workload", "concurrency", "variant", "req_per_s", "output_tok_per_s", "total_tok_per_s",
               "ttft_p50_ms", "ttft_p99_ms", "latency_p50_ms", "latency_p99_ms", "hit_rate", "serve_s_spread"]
    tiered = any(variant.endswith(HOST_TIER_SUFFIX) for variant in variants)
    if tiered:
        columns[-1:-1] = ["device_hit_rate", "host_hit_rate"]
    print(format_table(rows, columns))
    print("\nratios (throughput: higher is better for radix; ttft / latency: lower is better):")
    print(format_table(ratio_rows, ["workload", "concurrency", "ratio", "throughput", "ttft_p50", "latency_p50"]))
    copy_bandwidth = None
    if tiered:
        geometry = model.shape
        pages = max(1, min(4096, (256 << 20) // (kv_bytes_per_token * args.page_size)))  # ~256 MiB
        copy_bandwidth = measure_copy_bandwidth(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, dtype,
                                                device, args.page_size, pages)
        print("\nhost tier copy bandwidth vs a plain pinned-memory copy of the same bytes (same run):")
        print(format_table([copy_bandwidth], ["bytes", "tier_write_gb_s", "plain_d2h_gb_s", "write_ratio",
                                              "tier_load_gb_s", "plain_h2d_gb_s", "load_ratio"]))
    if verdicts:
        print("\nbars:")
        print(format_table(verdicts, ["workload", "concurrency", "bar", "measured", "met", "at_issue_sizes"]))
    return {
        "suite": SUITE, "schema": SCHEMA, "kvplug_version": __version__, "quick": preset == "quick",
        "preset": preset, "sizes": sizes.to_json(), "repeats": repeats, "variants": variants,
        "model": {"shape": shape, **describe_shape(shape), "dtype": str(dtype).removeprefix("torch."),
                  "device": str(device), "page_size": args.page_size, "attention": args.attention},
        "host": getattr(args, "host", DEFAULT_HOST), "environment": _environment(device, host),
        "elapsed_s": round(time.perf_counter() - started, 1),
        "results": rows, "runs": [run for group in runs.values() for run in group],
        "ratios": ratio_rows, "bars": verdicts, "copy_bandwidth": copy_bandwidth,
        "tier": {"working_set_ratios": working_set_ratios, "host_memory": host_memory},
    }


def _release_pool(device: torch.device) -> None:
    """Free the finished run's KV pool before the next variant allocates its own (GPU pools of
    tens of GB must not coexist)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _warm_up(host: E2EHost, model: BenchModel, variants: list[str], sizes: E2ESizes, args: argparse.Namespace,
             tier_options: dict[str, Any], *, with_tier_workload: bool = False) -> None:
    """One small generation per variant first, so one-time costs (lazy imports, kernel selection,
    allocator growth) land in no measured run; with a tier workload also a small one of it (with
    evictions, write-backs and loads) per variant."""
    warm = E2ESizes(requests=2, system_prompts=1, system_tokens=2 * args.page_size, question_tokens=8,
                    output_tokens=2, concurrency=(2,), conversations=4, turns=2, max_batch_tokens=sizes.max_batch_tokens)
    names = ["shared-prefix", *(["long-context-chat"] if with_tier_workload else [])]
    for name in names:
        workload = build_workload(name, warm, model.vocab_size, args.seed + 99)
        config = run_config(warm, workload, 2, args.page_size, args.attention, **{
            **tier_options, "host_memory": 64 * args.page_size * tier_options["kv_bytes_per_token"]})
        for variant in variants:
            host.run_variant(model, variant, config, workload)


def _environment(device: torch.device, host: E2EHost) -> dict[str, Any]:
    return {"python": platform.python_version(), "torch": torch.__version__, **host.versions(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"}
