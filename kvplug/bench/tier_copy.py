"""The host tier's copy bandwidth next to a plain pinned-memory copy of the same bytes, in one run.

``kvplug bench e2e`` reports it beside any ``+host`` variant: the tier's write-back (gather of a
node's pages for every layer into one staging buffer, then one copy per run of host pages) and
its load (copy into staging on the side stream, then a scatter into the pool) against
``pinned.copy_(device_buffer)`` of a contiguous buffer of the same size, each way. On the CPU the
"device" is host memory too: the figures then measure the gather/scatter overhead over memcpy.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from kvplug.memory.host_pool import HostKVPool


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(action: Any, device: torch.device, repeats: int) -> float:
    action()  # warm: first-call costs (kernel selection, allocator growth) are not bandwidth
    _synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        _synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def measure_copy_bandwidth(
    num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
    page_size: int, pages: int, *, repeats: int = 5,
) -> dict[str, Any]:
    """GB/s of the tier's write-back and load of ``pages`` scattered pages, and of plain pinned
    copies of the same bytes (device -> host and host -> device); ratios tier / plain."""
    kv_buffer = torch.randn((2, num_layers, 2 * pages + 1, page_size, kv_heads, head_dim), device=device).to(dtype)
    host = HostKVPool(kv_buffer, pages)
    host_pages = host.take(pages)
    # every other device page: a realistic scattered set, not one contiguous block
    # as the tiered cache passes them: host locations of whole pages
    locations = (np.arange(0, 2 * pages, 2)[:, None] * page_size + np.arange(page_size)).reshape(-1).astype(np.int32)
    nbytes = pages * host.bytes_per_page
    plain_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    plain_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    results = {
        "bytes": nbytes, "pages": pages, "page_bytes": host.bytes_per_page, "device": str(device),
        # synchronize(): the write's copies are issued by the tier's worker thread, after the call returns
        "tier_write_s": _best_seconds(lambda: (host.write(locations, host_pages), host.synchronize()), device, repeats),
        "plain_d2h_s": _best_seconds(lambda: plain_host.copy_(plain_device, non_blocking=True), device, repeats),
        "tier_load_s": _best_seconds(lambda: host.read(host_pages, locations), device, repeats),
        "plain_h2d_s": _best_seconds(lambda: plain_device.copy_(plain_host, non_blocking=True), device, repeats),
    }
    for name in ("tier_write", "plain_d2h", "tier_load", "plain_h2d"):
        results[f"{name}_gb_s"] = round(nbytes / results[f"{name}_s"] / 1e9, 3)
    results["write_ratio"] = round(results["plain_d2h_s"] / results["tier_write_s"], 4)  # = GB/s ratio
    results["load_ratio"] = round(results["plain_h2d_s"] / results["tier_load_s"], 4)
    assert np.array_equal(host_pages, np.arange(pages))  # one run of host pages: the copies are whole
    return results
