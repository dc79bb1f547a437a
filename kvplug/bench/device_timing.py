"""Device timing for the CUDA benchmark suites: CUDA-event timing of back-to-back calls, the same
calls replayed as one CUDA graph (launch cost excluded), interleaved repeats so clock drift weighs
on every implementation alike, the same-run copy bandwidth every figure is compared to, and the
docs/design.md, section 9 attention bars' verdicts."""

from __future__ import annotations

import argparse
import math
import random
import statistics
from typing import Any, Callable

import torch


def device_time_us(fn: Callable[[int], Any], calls: int, repeats: int, warmup: int = 3) -> float:
    """Median over ``repeats`` of the mean device time of ``calls`` back-to-back ``fn(i)``."""
    return interleaved_device_times({"fn": fn}, calls, repeats, warmup)["fn"]


def interleaved_device_times(
    fns: dict[str, Callable[[int], Any]], calls: int, repeats: int, warmup: int = 3
) -> dict[str, float]:
    """``device_time_us`` of several functions, their repeats interleaved (repeat r times every
    function once), so clock and thermal drift during the run weighs on all of them alike. Each
    repeat runs the functions in a new (seeded) random order, so no function always runs first
    or right after the same neighbour."""
    for fn in fns.values():
        for i in range(warmup):
            fn(i)
    samples: dict[str, list[float]] = {label: [] for label in fns}
    order = random.Random(0)
    for _ in range(repeats):
        for label in order.sample(list(fns), len(fns)):
            fn = fns[label]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(calls):
                fn(i)
            end.record()
            end.synchronize()
            samples[label].append(start.elapsed_time(end) * 1000 / calls)
    return {label: statistics.median(values) for label, values in samples.items()}


def capture_graph(fn: Callable[[int], Any], calls: int) -> torch.cuda.CUDAGraph:
    """``calls`` calls of ``fn`` captured in one CUDA graph (after an eager warm-up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return graph


def graph_times_us(fns: dict[str, Callable[[int], Any]], args: argparse.Namespace) -> dict[str, float]:
    """Device time per call with launch overhead removed: each function's ``args.calls`` calls
    replayed as one CUDA graph, replays interleaved across functions, median of ``args.repeats``.
    A function whose capture fails is reported (NaN) and the others still run."""
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    for label, fn in fns.items():
        try:
            graphs[label] = capture_graph(fn, args.calls)
        except Exception as error:  # report, keep benchmarking the rest
            print(f"graph capture failed for {label}: {error!r}")
    replays = {label: (lambda i, g=graph: g.replay()) for label, graph in graphs.items()}
    times = interleaved_device_times(replays, 1, args.repeats)
    return {label: times[label] / args.calls if label in times else float("nan") for label in fns}


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = device_time_us(lambda i: dst.copy_(src), calls=5, repeats=7)
    return 2 * nbytes / (us * 1e-6)


def check_bars(store: dict, metadata: list[dict], decode: list[dict]) -> list[dict[str, Any]]:
    """docs/design.md, section 9's attention bars against this run's figures, each with its worst case."""
    bars: list[dict[str, Any]] = []

    def worst(name: str, rows: list[dict], key: str, ok: Callable[[float], bool], lowest: bool = True) -> None:
        rows = [row for row in rows if key in row and not math.isnan(row[key])]
        if rows:
            row = (min if lowest else max)(rows, key=lambda r: r[key])
            where = ", ".join(f"{k}={row[k]}" for k in ("page", "bs", "ctx", "impl") if k in row)
            bars.append({"bar": name, "worst": row[key], "where": where, "met": bool(ok(row[key]))})

    flashinfer = [row for row in decode if row["impl"] == "flashinfer"]
    worst("flashinfer backend / direct FlashInfer >= 0.97", flashinfer, "vs_fi_direct", lambda x: x >= 0.97)
    big = [row for row in decode if row["impl"] == "triton" and row["bs"] >= 64]
    worst("triton / direct FlashInfer >= 0.80 (batch >= 64)", big, "vs_fi_direct", lambda x: x >= 0.80)
    worst("store_kv / copy bandwidth >= 0.80", [store], "triton_of_copy", lambda x: x >= 0.80)
    at_256 = [row for row in metadata if row["bs"] == 256]
    for key in ("triton_total_us", "flashinfer_total_excl_plan_us", "flashinfer_token_view_total_excl_plan_us"):
        worst(f"{key} <= 50 us at bs 256", at_256, key, lambda x: x <= 50.0, lowest=False)
    return bars
