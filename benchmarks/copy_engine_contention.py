"""Does a big host<->device copy on a side stream delay a small copy on the compute stream?

The host-memory tier moves whole prefixes (hundreds of MiB) on its own copy stream while the host
engine keeps copying a few bytes per step (sampled ids to the host, inputs to the device) on the
compute stream. If both directions' copies share one DMA queue, the small copy waits behind the
big one and every step in between stalls. This measures it on the machine at hand: the latency
of a 1 KiB copy alone, and issued right after a big copy (in 64 MiB and 8 MiB chunks, as the
tier's staging sizes) was queued on a side stream, for both directions.

    python benchmarks/copy_engine_contention.py [--total-mib 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def small_copy_ms(dst: torch.Tensor, src: torch.Tensor) -> float:
    stream = torch.cuda.current_stream()
    started = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    stream.synchronize()
    return (time.perf_counter() - started) * 1e3


def queue_copy(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, chunk: int) -> None:
    """Queue ``dst.copy_(src)`` (flat uint8 tensors) on ``stream`` in ``chunk``-byte copies; no wait."""
    with torch.cuda.stream(stream):
        for begin in range(0, dst.numel(), chunk):
            dst[begin : begin + chunk].copy_(src[begin : begin + chunk], non_blocking=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    total = args.total_mib << 20
    device_big = torch.empty(total, dtype=torch.uint8, device="cuda")
    host_big = torch.empty(total, dtype=torch.uint8).pin_memory()
    small_dev = torch.zeros(256, dtype=torch.int32, device="cuda")
    small_host = torch.zeros(256, dtype=torch.int32).pin_memory()
    side = torch.cuda.Stream()
    for _ in range(5):
        small_copy_ms(small_host, small_dev), small_copy_ms(small_dev, small_host)
    idle_d2h = statistics.median(small_copy_ms(small_host, small_dev) for _ in range(50))
    idle_h2d = statistics.median(small_copy_ms(small_dev, small_host) for _ in range(50))
    print(f"idle: small D2H {idle_d2h:.3f} ms, small H2D {idle_h2d:.3f} ms")
    small = {"D2H": (small_host, small_dev), "H2D": (small_dev, small_host)}
    idle = {"D2H": idle_d2h, "H2D": idle_h2d}
    for chunk_mib in (64, 8):
        for direction, (dst, src) in (("D2H", (host_big, device_big)), ("H2D", (device_big, host_big))):
            for small_direction in (direction, "H2D" if direction == "D2H" else "D2H"):
                waits, big_ms = [], []
                for _ in range(args.repeats):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    queue_copy(side, dst, src, chunk_mib << 20)
                    waits.append(small_copy_ms(*small[small_direction]))
                    side.synchronize()
                    big_ms.append((time.perf_counter() - started) * 1e3)
                print(f"big {direction} of {args.total_mib} MiB in {chunk_mib} MiB chunks ({statistics.median(big_ms):.1f} ms): "
                      f"small {small_direction} copy waits {statistics.median(waits):.3f} ms "
                      f"(idle {idle[small_direction]:.3f})")
    tier_write_back(args)
    queue_depth(args)


def tier_write_back(args: argparse.Namespace) -> None:
    """The same question through the host tier's own write-back (``HostKVPool.write``, paced)."""
    from kvplug.memory.host_pool import HostKVPool

    # Qwen3-0.6B's page at page size 16: 28 layers, 8 KV heads of 128, bf16 (1.75 MiB per page)
    kv = torch.zeros(2, 28, 1025, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    host = HostKVPool(kv, 1024)
    count = min(1024, (args.total_mib << 20) // host.bytes_per_page)
    pages = host.take(count)
    locations = np.repeat(np.arange(count) * 16, 16) + np.tile(np.arange(16), count)
    small_dev = torch.zeros(256, dtype=torch.int32, device="cuda")
    small_host = torch.zeros(256, dtype=torch.int32).pin_memory()
    host.write(locations, pages)
    host.synchronize()
    waits, totals = [], []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        host.write(locations, pages)
        waits.append(small_copy_ms(small_host, small_dev))
        host.synchronize()
        totals.append((time.perf_counter() - started) * 1e3)
    total_ms = statistics.median(totals)
    print(f"tier write-back of {count * host.bytes_per_page / 2**20:.0f} MiB ({total_ms:.1f} ms, "
          f"{count * host.bytes_per_page / total_ms / 1e6:.1f} GB/s): small D2H copy on the compute stream waits "
          f"{statistics.median(waits):.3f} ms")


def queue_depth(args: argparse.Namespace) -> None:
    """How long does a small device -> host copy wait behind 1, 2, 4, 16 queued 16 MiB chunks, and
    behind another thread blocked in ``Event.synchronize`` on a long copy?"""
    import threading

    chunk = 16 << 20
    device_big = torch.empty(64 * chunk, dtype=torch.uint8, device="cuda")
    host_big = torch.empty(64 * chunk, dtype=torch.uint8).pin_memory()
    small_dev = torch.zeros(256, dtype=torch.int32, device="cuda")
    small_host = torch.zeros(256, dtype=torch.int32).pin_memory()
    side = torch.cuda.Stream()
    for depth in (1, 2, 4, 16, 64):
        waits = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            queue_copy(side, host_big[: depth * chunk], device_big[: depth * chunk], chunk)
            waits.append(small_copy_ms(small_host, small_dev))
            side.synchronize()
        print(f"{depth:3d} x 16 MiB D2H queued on a side stream: small D2H waits {statistics.median(waits):.3f} ms")
    # another thread issues one chunk at a time and blocks on its event between chunks
    waits = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        started = threading.Event()

        def worker() -> None:
            with torch.cuda.stream(side):
                for i in range(64):
                    host_big[i * chunk : (i + 1) * chunk].copy_(device_big[i * chunk : (i + 1) * chunk], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(side)
                    started.set()
                    done.synchronize()

        thread = threading.Thread(target=worker)
        thread.start()
        started.wait()
        waits.append(small_copy_ms(small_host, small_dev))
        thread.join()
    print(f"a thread issuing 64 x 16 MiB one at a time: small D2H waits {statistics.median(waits):.3f} ms")
    # kvplug.memory.paced_copies (the host tier's worker), with and without gathers first
    from kvplug.memory.paced_copies import PacedHostCopies

    for in_flight in (1, 2):
        paced = PacedHostCopies(side, chunk_bytes=chunk, max_in_flight=in_flight)
        for gather in (False, True):
            waits, totals = [], []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                started = time.perf_counter()
                for i in range(4):
                    source = device_big[i * 16 * chunk : (i + 1) * 16 * chunk]
                    if gather:
                        source = source.view(16, chunk)[torch.arange(16, device="cuda")]
                    ready = torch.cuda.Event()
                    ready.record(torch.cuda.current_stream())
                    paced.submit(host_big[i * 16 * chunk : (i + 1) * 16 * chunk].view(16, chunk), source.view(16, chunk),
                                 ready, np.arange(i * 16, (i + 1) * 16))
                waits.append(small_copy_ms(small_host, small_dev))
                paced.issue_through()
                side.synchronize()
                totals.append((time.perf_counter() - started) * 1e3)
            print(f"PacedHostCopies in flight {in_flight}{' after gathers' if gather else ''}: 1 GiB in "
                  f"{statistics.median(totals):.1f} ms, small D2H waits {statistics.median(waits):.3f} ms")
        paced.close()


if __name__ == "__main__":
    main()
