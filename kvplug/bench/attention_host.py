"""Host-side costs for ``kvplug bench attention``: kvplug's per-step metadata work (batch build,
FlashInfer page lists) with FlashInfer's own ``plan()`` split out, and the primitive operations it
is made of, timed on the host with the device synchronised between calls."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch


def host_us(fn: Callable[[], Any], iters: int = 300) -> float:
    """Median host time of ``fn`` (the device is synchronised between calls, outside the timing)."""
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples[iters // 10 :])


def bench_metadata(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Host time per decode step of kvplug's own metadata work, FlashInfer's plan() apart.

    What ``KVBackend.prepare`` runs per decode step: the stager (with the page lists of the
    backend's view when it plans with them), then the backend's ``prepare_metadata``, timed
    twice: whole, and with the wrappers' ``plan`` replaced by a no-op (the rest of it).
    """
    import numpy as np

    import kvplug
    from kvplug.attention.batch import build_attention_batch
    from kvplug.attention.decode_staging import DecodeStager
    from kvplug.bench.attention import DecodeSetup
    from kvplug.interface import ForwardPhase

    rows = []
    for bs in (int(b) for b in args.metadata_batch_sizes.split(",")):
        setup = DecodeSetup(args, bs, 2048, 16)
        table = setup.page_table
        live, cached, lens = list(range(bs)), [2047] * bs, [2048] * bs
        live_rows, cached_lens = np.arange(bs, dtype=np.int64), np.full(bs, 2047, dtype=np.int64)
        row: dict[str, Any] = {"bs": bs}
        # the public builder a host calls with Python lists, validating them
        validated = lambda: build_attention_batch(table, live, cached, lens, ForwardPhase.DECODE)  # noqa: E731
        row["validated_build_us"] = round(host_us(validated), 1)
        for name in args.backends.split(","):
            views = [("", {})] if name != "flashinfer" else [("", {}), ("_token_view", {"kv_view": "token"})]
            for suffix, options in views:
                backend = kvplug.create_attention_backend(name, setup.config(**options))
                stager = DecodeStager(table, torch.zeros_like(table), page_size=16, page_list_size=backend.decode_page_list_size)
                stage = lambda: stager.stage(live_rows, cached_lens)  # noqa: E731
                label = f"{name}{suffix}"
                row[f"{label}_build_batch_us"] = round(host_us(stage), 1)
                batch = stage()
                row[f"{label}_prepare_us"] = round(host_us(lambda: backend.prepare_metadata(batch)), 1)
                if name != "flashinfer":
                    row[f"{label}_total_us"] = round(row[f"{label}_build_batch_us"] + row[f"{label}_prepare_us"], 1)
                    continue
                for wrapper in (backend._decode_wrapper, backend._prefill_wrapper):
                    wrapper.plan = lambda *a, **k: None  # an instance attribute: this backend only
                rest = round(host_us(lambda: backend.prepare_metadata(batch)), 1)
                row[f"{label}_plan_us"] = round(row[f"{label}_prepare_us"] - rest, 1)
                row[f"{label}_total_excl_plan_us"] = round(row[f"{label}_build_batch_us"] + rest, 1)
                if not suffix:  # page lists of a batch the stager did not build (a host's own)
                    indices = backend._indices
                    build = lambda: indices.build(batch.table_rows, batch.device_lens_cpu, batch.device_lens)  # noqa: E731
                    row["flashinfer_unstaged_page_lists_us"] = round(host_us(build), 1)
        rows.append(row)
        del setup
    return rows


def bench_host_ops() -> list[dict[str, Any]]:
    """Host cost of the primitive operations the metadata path is made of, on this machine."""
    import numpy as np

    from kvplug.kernels.store_kv import store_kv_triton

    dev = torch.device("cuda")
    pageable, pinned = torch.zeros(1024, dtype=torch.int32), torch.zeros(1024, dtype=torch.int32, pin_memory=True)
    table = torch.zeros(257 * 2048, dtype=torch.int32, device=dev)
    index = torch.arange(256, dtype=torch.int32, device=dev)
    counts = torch.full((256,), 128, dtype=torch.int32, device=dev)
    cache = torch.zeros(64, 8, 128, dtype=torch.bfloat16, device=dev)
    one = torch.zeros(1, 8, 128, dtype=torch.bfloat16, device=dev)
    loc = torch.zeros(1, dtype=torch.int32, device=dev)
    array = np.arange(256)
    ops = {
        "numpy cumsum 256": lambda: np.cumsum(array),
        "torch.empty pinned 4KB": lambda: torch.empty(1024, dtype=torch.int32, pin_memory=True),
        "H2D 4KB pageable": lambda: pageable.to(dev, non_blocking=True),
        "H2D 4KB pinned": lambda: pinned.to(dev, non_blocking=True),
        "index_select 256": lambda: table.index_select(0, index),
        "add 256": lambda: torch.add(index, index, alpha=3),
        "repeat_interleave 256->32k": lambda: torch.repeat_interleave(index, counts, output_size=32768),
        "split_with_sizes x6": lambda: pinned.split_with_sizes((170, 170, 170, 171, 171, 172)),
        "triton store_kv launch (1 token)": lambda: store_kv_triton(cache, cache, loc, one, one),
    }
    return [{"op": name, "host_us": round(host_us(fn), 2)} for name, fn in ops.items()]
