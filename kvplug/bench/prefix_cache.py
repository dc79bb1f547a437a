"""Per-call host latency of prefix caches, side by side (targets: docs/design.md, "Performance targets").

Workloads, at each page size (default 1 and 16):

- ``shared-prefix``: 1,000 requests of 2,048 shared + 512 unique tokens; each request does
  match+lock, reads the matched indices, inserts its whole prompt, then unlocks;
- ``conversation``: 200 conversations x 8 turns x 256 tokens, turn by turn; each turn matches
  the conversation so far (the previous turns are cached) and inserts it extended by one turn;
- ``evict``: ``evict(256)`` repeatedly on a tree of 10,000 leaves (100 groups of a 128-token
  prefix with 100 leaves of 32 tokens each); 50 timed calls leave over 9,500 leaves.

Every call is timed on its own (``perf_counter_ns``, cyclic GC paused during the timed loop);
each workload first runs once untimed per cache (a warm-up: in a fresh process the first workload
otherwise pays the heap's growth, which a serving process has paid long ago: BENCHMARKS.md);
``--repeat N`` then runs each workload N times per cache,
the caches taking turns, and reports the median of the runs' percentiles with the lowest and
highest run p50 beside it;
inputs are built in each implementation's native form before timing (kvplug's own caches: host
int32 arrays, as its allocator passes them; ``--tensor-inputs``: tensors, as a third party would). SGLang's RadixCache runs
the same workloads in the same process when it imports (see ``sglang_anchor``), and
``speedups`` are SGLang's latency divided by kvplug's. ``--quick`` shrinks every size ~20x.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any, Callable

import numpy as np
import torch

from kvplug._version import __version__
from kvplug.bench.prefix_cache_drivers import CacheDriver, CheckedKvplugDriver, KvplugDriver
from kvplug.bench.timing import format_table, gc_paused, summarize_ns

SUITE = "prefix-cache"
SCHEMA = 1
VOCAB = 32_000
FULL = dict(requests=1000, shared=2048, unique=512, conversations=200, turns=8, turn_tokens=256,
            groups=100, leaves_per_group=100, group_prefix=128, leaf_tokens=32, evict_tokens=256, evict_calls=50)
QUICK = dict(requests=50, shared=256, unique=64, conversations=10, turns=4, turn_tokens=64,
             groups=10, leaves_per_group=50, group_prefix=64, leaf_tokens=32, evict_tokens=64, evict_calls=10)
# the radix cache's bars (SPEC section 7) on the full-size workloads: (workload, operation) -> p50 bar in us
BARS_US = {("shared-prefix", "match+lock"): 5.0, ("shared-prefix", "insert"): 6.0, ("evict", "evict"): 100.0}
MIN_SPEEDUP = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-sizes", default="1,16", help="comma-separated page sizes (default 1,16)")
    parser.add_argument("--caches", default="radix", help="comma-separated kvplug prefix caches (default radix)")
    parser.add_argument("--no-sglang", action="store_true", help="skip SGLang's RadixCache even if it imports")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", metavar="DIR", default=None,
                        help="also run the radix cache of another version in the same process: DIR is a copy of its "
                             "kvplug/prefix_cache (e.g. git archive REF kvplug/prefix_cache | tar -x -C /tmp)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every workload N times per cache, the caches taking turns (in alternating order), "
                             "and report the median of the N runs' percentiles (for a busy machine; default 1)")
    parser.add_argument("--tensor-inputs", action="store_true",
                        help="drive kvplug's caches through the public tensor methods only, as a third-party caller "
                             "would (default: host arrays where a cache takes them, as kvplug's allocator does)")
    parser.add_argument("--checked", action="store_true",
                        help="also run each cache behind CheckedPrefixCache (how a KVBackend runs an untrusted plugin)")


Timings = dict[str, list[int]]


def _time(timings: Timings, operation: str, call: Callable[[], Any]) -> Any:
    start = time.perf_counter_ns()
    result = call()
    timings.setdefault(operation, []).append(time.perf_counter_ns() - start)
    return result


def shared_prefix(driver: CacheDriver, sizes: dict, rng: np.random.Generator) -> tuple[Timings, dict]:
    shared = rng.integers(0, VOCAB, sizes["shared"], dtype=np.int32)
    length = sizes["shared"] + sizes["unique"]
    items = []
    for request in range(sizes["requests"]):
        ids = np.concatenate([shared, rng.integers(0, VOCAB, sizes["unique"], dtype=np.int32)])
        items.append(driver.prepare(ids, np.arange(request * length, (request + 1) * length, dtype=np.int32)))
    timings: Timings = {}
    hits = []
    with gc_paused():
        for item in items:
            matched = _time(timings, "match+lock", lambda: driver.match_lock(item))
            _time(timings, "indices", lambda: driver.matched_indices(matched))
            _time(timings, "insert", lambda: driver.insert(item))
            driver.unlock(matched)
            hits.append(driver.cached_len(matched))
    return timings, {"hit_tokens_mean": float(np.mean(hits)), "cached_tokens": driver.total_tokens()}


def conversation(driver: CacheDriver, sizes: dict, rng: np.random.Generator) -> tuple[Timings, dict]:
    length = sizes["turns"] * sizes["turn_tokens"]
    turns: list[list[Any]] = [[] for _ in range(sizes["turns"])]
    for index in range(sizes["conversations"]):
        ids = rng.integers(0, VOCAB, length, dtype=np.int32)
        locations = np.arange(index * length, (index + 1) * length, dtype=np.int32)
        for turn in range(1, sizes["turns"] + 1):
            end = turn * sizes["turn_tokens"]
            turns[turn - 1].append(driver.prepare(ids[:end], locations[:end]))
    timings: Timings = {}
    hits = []
    with gc_paused():
        for items in turns:
            for item in items:
                matched = _time(timings, "match+lock", lambda: driver.match_lock(item))
                _time(timings, "insert", lambda: driver.insert(item))
                driver.unlock(matched)
                hits.append(driver.cached_len(matched))
    return timings, {"hit_tokens_mean": float(np.mean(hits)), "cached_tokens": driver.total_tokens()}


def evict(driver: CacheDriver, sizes: dict, rng: np.random.Generator) -> tuple[Timings, dict]:
    sequence = sizes["group_prefix"] + sizes["leaf_tokens"]
    location = 0
    for _ in range(sizes["groups"]):
        prefix = rng.integers(0, VOCAB, sizes["group_prefix"], dtype=np.int32)
        for _ in range(sizes["leaves_per_group"]):
            ids = np.concatenate([prefix, rng.integers(0, VOCAB, sizes["leaf_tokens"], dtype=np.int32)])
            driver.insert(driver.prepare(ids, np.arange(location, location + sequence, dtype=np.int32)))
            location += sequence
    leaves = sizes["groups"] * sizes["leaves_per_group"]
    if driver.total_tokens() < sizes["evict_tokens"] * sizes["evict_calls"]:  # e.g. naive keeps nothing
        return {}, {"leaves_before": leaves, "skipped": f"{driver.name} holds {driver.total_tokens()} tokens"}
    timings: Timings = {}
    freed = []
    with gc_paused():
        for _ in range(sizes["evict_calls"]):
            freed.append(_time(timings, "evict", lambda: driver.evict(sizes["evict_tokens"])))
    return timings, {"leaves_before": leaves, "freed_tokens_mean": float(np.mean(freed))}


WORKLOADS = {"shared-prefix": shared_prefix, "conversation": conversation, "evict": evict}


def _drivers(args: argparse.Namespace, page_size: int, sglang_version: str | None,
             baseline: type | None = None) -> list[CacheDriver]:
    tensor_inputs = getattr(args, "tensor_inputs", False)
    drivers: list[CacheDriver] = [KvplugDriver(name, page_size, tensor_inputs=tensor_inputs)
                                  for name in filter(None, args.caches.split(","))]
    if baseline is not None:
        from kvplug.bench.prefix_cache_baseline import BaselineRadixDriver

        drivers.append(BaselineRadixDriver(baseline, page_size, tensor_inputs=tensor_inputs))
    if getattr(args, "checked", False):
        drivers += [CheckedKvplugDriver(name, page_size) for name in filter(None, args.caches.split(","))]
    if sglang_version:
        from kvplug.bench.sglang_anchor import SGLangRadixDriver

        drivers.append(SGLangRadixDriver(page_size))
    return drivers


def _speedups(rows: list[dict]) -> list[dict]:
    anchors = {(r["workload"], r["page_size"], r["operation"]): r for r in rows if r["cache"] == "sglang-radix"}
    speedups = []
    for row in rows:
        anchor = anchors.get((row["workload"], row["page_size"], row["operation"]))
        if anchor is None or row is anchor:
            continue
        speedups.append({
            "workload": row["workload"], "page_size": row["page_size"], "operation": row["operation"],
            "cache": row["cache"], "sglang_p50_us": anchor["p50_us"], "sglang_p99_us": anchor["p99_us"],
            "p50_speedup": round(anchor["p50_us"] / row["p50_us"], 2),
            "p99_speedup": round(anchor["p99_us"] / row["p99_us"], 2),
        })
    return speedups


def _bars(rows: list[dict], speedups: list[dict], full_size: bool) -> list[dict]:
    """SPEC section 7 verdicts for ``kvplug-radix`` (meaningful only at full size)."""
    ratio = {(s["workload"], s["page_size"], s["operation"]): s["p50_speedup"] for s in speedups
             if s["cache"] == "kvplug-radix"}
    verdicts = []
    for row in rows:
        bar = BARS_US.get((row["workload"], row["operation"]))
        if bar is None or row["cache"] != "kvplug-radix":
            continue
        speedup = ratio.get((row["workload"], row["page_size"], row["operation"]))
        verdicts.append({
            "workload": row["workload"], "page_size": row["page_size"], "operation": row["operation"],
            "p50_us": row["p50_us"], "bar_us": bar, "speedup": speedup, "bar_speedup": MIN_SPEEDUP,
            "met": full_size and row["p50_us"] <= bar and (speedup is None or speedup >= MIN_SPEEDUP),
        })
    return verdicts


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = QUICK if getattr(args, "quick", False) else FULL
    page_sizes = [int(size) for size in args.page_sizes.split(",") if size]
    sglang_version, sglang_missing = (None, "disabled by --no-sglang") if args.no_sglang else _sglang_status()
    baseline = None
    if getattr(args, "baseline", None):
        from kvplug.bench.prefix_cache_baseline import load_baseline_radix

        baseline = load_baseline_radix(args.baseline)
    repeat = getattr(args, "repeat", 1)
    if repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, got {repeat}")
    rows: list[dict] = []
    for page_size in page_sizes:
        for workload, function in WORKLOADS.items():
            runs: dict[tuple[str, str], list[dict]] = {}
            facts_of: dict[str, dict] = {}
            for driver in _drivers(args, page_size, sglang_version, baseline):  # warm-up, not timed
                function(driver, sizes, np.random.default_rng(args.seed))
            for round_ in range(repeat):
                drivers = _drivers(args, page_size, sglang_version, baseline)  # fresh caches every round
                for driver in drivers if round_ % 2 == 0 else drivers[::-1]:
                    timings, facts_of[driver.name] = function(driver, sizes, np.random.default_rng(args.seed))
                    for operation, samples in timings.items():
                        runs.setdefault((driver.name, operation), []).append(summarize_ns(samples))
            for (cache, operation), summaries in runs.items():
                rows.append({"workload": workload, "page_size": page_size, "operation": operation, "cache": cache,
                             **_median_summary(summaries), **facts_of[cache]})
    speedups = _speedups(rows)
    bars = _bars(rows, speedups, full_size=sizes is FULL)
    print(format_table(rows, ["workload", "page_size", "operation", "cache", "n", "p50_us", "p99_us", "mean_us"]
                       + (["p50_low_us", "p50_high_us"] if repeat > 1 else [])))
    if speedups:
        print("\nspeed-up over SGLang's RadixCache (SGLang us / kvplug us):")
        print(format_table(speedups, ["workload", "page_size", "operation", "cache", "p50_speedup", "p99_speedup"]))
    else:
        print(f"\nSGLang's RadixCache not measured: {sglang_missing}")
    versus_baseline = _versus_baseline(rows)
    if versus_baseline:
        print(f"\nbaseline ({args.baseline}) us / kvplug-radix us:")
        print(format_table(versus_baseline, ["workload", "page_size", "operation", "baseline_p50_us", "p50_us",
                                             "p50_ratio"]))
    return {
        "suite": SUITE, "schema": SCHEMA, "kvplug_version": __version__, "quick": sizes is QUICK, "sizes": sizes,
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
                        "cpu_count": os.cpu_count(), "platform": platform.platform(), "sglang": sglang_version,
                        "sglang_missing": sglang_missing},
        "results": rows, "speedups": speedups, "bars": bars, "baseline": getattr(args, "baseline", None),
        "versus_baseline": versus_baseline,
    }


def _median_summary(summaries: list[dict]) -> dict:
    """One row from the runs of one operation: the median of each run's percentiles, the samples of
    all runs counted, and the lowest and highest run p50 (how noisy the machine was)."""
    p50s = [summary["p50_us"] for summary in summaries]
    return {
        "n": sum(summary["n"] for summary in summaries),
        **{key: round(float(np.median([summary[key] for summary in summaries])), 3)
           for key in ("p50_us", "p99_us", "mean_us")},
        "min_us": min(summary["min_us"] for summary in summaries),
        "runs": len(summaries), "p50_low_us": min(p50s), "p50_high_us": max(p50s),
    }


def _versus_baseline(rows: list[dict]) -> list[dict]:
    """``kvplug-radix`` beside ``baseline-radix`` (``--baseline``), row by row."""
    base = {(r["workload"], r["page_size"], r["operation"]): r for r in rows if r["cache"] == "baseline-radix"}
    return [
        {"workload": row["workload"], "page_size": row["page_size"], "operation": row["operation"],
         "baseline_p50_us": anchor["p50_us"], "p50_us": row["p50_us"],
         "p50_ratio": round(anchor["p50_us"] / row["p50_us"], 2)}
        for row in rows
        if row["cache"] == "kvplug-radix" and (anchor := base.get((row["workload"], row["page_size"], row["operation"])))
    ]


def _sglang_status() -> tuple[str | None, str | None]:
    from kvplug.bench.sglang_anchor import sglang_status

    return sglang_status()
