"""Host time of one decode step through ``KVBackend``, phase by phase.

The target (docs/design.md, "Performance targets"): host-side work per decode step (allocation,
table write, metadata) <= 50 us at bs 256, excluding the attention library's own plan(). A
memory-only backend (``attention=None``, so no plan() at all) admits ``bs`` requests with prompts
of random lengths (so page boundaries are crossed on different steps), prefills them, then runs
decode steps two ways, each timed phase by phase (``perf_counter_ns``, cyclic GC paused):

- ``step``: the explicit step, ``begin_decode`` (pages, batch, input ids) then ``commit``;
- ``calls``: the same step call by call, ``allocate -> prepare("decode") -> input_ids ->
  append_tokens``.

Each variant's clean run is repeated (``--repeats``, fresh backend each time) and the repeat
with the lowest median step time is reported, as ``timeit`` reports its best repeat: on a
machine shared with other work, bursts of contention inflate a whole repeat. A second,
instrumented run of the explicit step times two sub-phases by wrapping them: ``table_write``
(the allocator's page-table write; on GPU tables a step's pages are written by its staging
launch, so it stays empty there) and ``batch_build`` (building the ``AttentionBatch``); the
wrappers add ~0.2 us each, which is why the phase figures come from the clean run. On CUDA the
device is synchronised between steps, outside the timed region, so every figure is host time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch

from kvplug._version import __version__
from kvplug.bench.timing import format_table, gc_paused, summarize_ns

SUITE = "host-step"
SCHEMA = 1
FULL = dict(batch_sizes=(1, 64, 256), steps=500, warmup=20, min_prompt=64, max_prompt=512)
QUICK = dict(batch_sizes=(1, 8), steps=20, warmup=3, min_prompt=8, max_prompt=40)
STEP_PHASES = ("begin_decode", "commit")
CALL_PHASES = ("allocate", "prepare", "input_ids", "append")
PHASES = STEP_PHASES + CALL_PHASES
SUB_PHASES = ("table_write", "batch_build")
BAR_BATCH_SIZE = 256
BAR_US = 50.0  # begin_decode (pages, table write, batch, input ids) + commit, p50, at bs 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-sizes", default="1,16", help="comma-separated page sizes (default 1,16)")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default 1,64,256)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per case (default 500)")
    parser.add_argument("--device", default="cpu", help="where pool and tables live: cpu (default) or cuda")
    parser.add_argument("--prefix-cache", default="naive", help="prefix cache name (default naive)")
    parser.add_argument("--repeats", type=int, default=3, help="clean runs per case; the quietest is reported")
    parser.add_argument("--seed", type=int, default=0)


def make_backend(bs: int, page_size: int, sizes: dict, steps: int, device: str, prefix_cache: str):
    """A memory-only backend big enough for ``bs`` requests of up to ``max_prompt + steps`` tokens."""
    from kvplug.backend import ModelShape, create_backend

    shape = ModelShape(num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=8, dtype=torch.float16)
    max_seq_len = sizes["max_prompt"] + sizes["warmup"] + steps + 2
    num_pages = bs * -(-max_seq_len // page_size) + 1
    return create_backend(shape, page_size=page_size, num_pages=num_pages, max_running_reqs=max(bs, 1),
                          max_seq_len=max_seq_len, prefix_cache=prefix_cache, attention=None, device=device)


def admit_and_prefill(backend, bs: int, sizes: dict, rng: np.random.Generator) -> list:
    lengths = rng.integers(sizes["min_prompt"], sizes["max_prompt"] + 1, bs)
    requests = [backend.admit(rng.integers(0, 32_000, int(n)).tolist()) for n in lengths]
    backend.allocate(requests)
    backend.prepare(requests, "prefill")
    backend.append_tokens(requests, torch.ones(bs, dtype=torch.int32, device=backend.device))
    return requests


def decode_steps(backend, requests: list, steps: int, sync: Callable[[], None], *, explicit: bool = True,
                 ) -> dict[str, list[int]]:
    """Run ``steps`` decode steps (explicit, or call by call), timing each phase; returns
    nanoseconds per phase."""
    sampled = torch.ones(len(requests), dtype=torch.int32, device=backend.device)
    phases = STEP_PHASES if explicit else CALL_PHASES
    timings: dict[str, list[int]] = {phase: [] for phase in phases}
    clock = time.perf_counter_ns
    with gc_paused():
        for _ in range(steps):
            sync()
            if explicit:
                t0 = clock()
                step = backend.begin_decode(requests)
                t1 = clock()
                step.commit(sampled)
                t2 = clock()
                timings["begin_decode"].append(t1 - t0)
                timings["commit"].append(t2 - t1)
                continue
            t0 = clock()
            backend.allocate(requests)
            t1 = clock()
            batch = backend.prepare(requests, "decode")
            t2 = clock()
            backend.input_ids(batch)
            t3 = clock()
            backend.append_tokens(requests, sampled)
            t4 = clock()
            for phase, begin, end in zip(CALL_PHASES, (t0, t1, t2, t3), (t1, t2, t3, t4)):
                timings[phase].append(end - begin)
    return timings


@contextlib.contextmanager
def timed_attribute(owner: Any, name: str, sink: list[int]) -> Iterator[None]:
    """Replace ``owner.name`` by a wrapper that appends each call's duration (ns) to ``sink``."""
    original = getattr(owner, name)
    clock = time.perf_counter_ns

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(clock() - start)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def sub_phase_targets(backend) -> dict[str, list[tuple[Any, str]]]:
    """Where the sub-phases live: (object, attribute) pairs wrapped for timing. A decode step's
    new pages are noted in the host table by ``PageTable.record_decode_pages`` (the staging
    launch writes the device's); its batch is built by the backend's ``DecodeStager`` (one
    decode path on every device)."""
    return {"table_write": [(backend.tables, "record_decode_pages")], "batch_build": [(backend.stager, "stage")]}


def run_case(bs: int, page_size: int, sizes: dict, steps: int, args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def fresh_decoding_backend():
        backend = make_backend(bs, page_size, sizes, steps, args.device, args.prefix_cache)
        requests = admit_and_prefill(backend, bs, sizes, np.random.default_rng(args.seed))
        decode_steps(backend, requests, sizes["warmup"], sync)
        return backend, requests

    results: dict[str, list[int]] = {}
    for explicit, total, phases in ((True, "step", STEP_PHASES), (False, "calls_step", CALL_PHASES)):
        best: dict[str, list[int]] | None = None
        for _ in range(max(args.repeats, 1)):
            backend, requests = fresh_decoding_backend()
            timings = decode_steps(backend, requests, steps, sync, explicit=explicit)
            timings[total] = [sum(parts) for parts in zip(*(timings[phase] for phase in phases))]
            if best is None or np.median(timings[total]) < np.median(best[total]):
                best = timings
        results.update(best)
    results["calls_step_excl_input_ids"] = [
        a + p + w for a, p, w in zip(results["allocate"], results["prepare"], results["append"])
    ]
    backend, requests = fresh_decoding_backend()
    with contextlib.ExitStack() as stack:
        for phase, targets in sub_phase_targets(backend).items():
            results[phase] = []
            for owner, name in targets:  # one step calls one of them
                if hasattr(owner, name):
                    stack.enter_context(timed_attribute(owner, name, results[phase]))
        decode_steps(backend, requests, steps, sync)
    backend.check_integrity()
    return [{"bs": bs, "page_size": page_size, "phase": phase, **summarize_ns(samples)}
            for phase, samples in results.items()]


def _bars(rows: list[dict], full_size: bool) -> list[dict]:
    return [{"bs": row["bs"], "page_size": row["page_size"], "p50_us": row["p50_us"], "bar_us": BAR_US,
             "met": full_size and row["p50_us"] <= BAR_US}
            for row in rows if row["phase"] == "step" and row["bs"] == BAR_BATCH_SIZE]


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = dict(QUICK if getattr(args, "quick", False) else FULL)
    if args.batch_sizes:
        sizes["batch_sizes"] = tuple(int(b) for b in args.batch_sizes.split(",") if b)
    steps = args.steps or sizes["steps"]
    page_sizes = [int(size) for size in args.page_sizes.split(",") if size]
    rows: list[dict] = []
    for page_size in page_sizes:
        for bs in sizes["batch_sizes"]:
            rows.extend(run_case(bs, page_size, sizes, steps, args))
    full_size = not getattr(args, "quick", False) and steps >= FULL["steps"]
    bars = _bars(rows, full_size)
    print(format_table(rows, ["bs", "page_size", "phase", "n", "p50_us", "p99_us", "mean_us", "min_us"]))
    for bar in bars:
        verdict = "met" if bar["met"] else "NOT met"
        print(f"bs {bar['bs']} page {bar['page_size']}: begin_decode+commit p50 {bar['p50_us']:.1f} us "
              f"(bar {BAR_US:.0f} us): {verdict}")
    return {
        "suite": SUITE, "schema": SCHEMA, "kvplug_version": __version__, "quick": bool(getattr(args, "quick", False)),
        "sizes": {**sizes, "steps": steps}, "device": args.device, "prefix_cache": args.prefix_cache,
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
                        "cpu_count": os.cpu_count(), "platform": platform.platform()},
        "results": rows, "bars": bars,
    }
