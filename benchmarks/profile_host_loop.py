"""Where a continuous-batching step's wall time goes through the transformers host.

Runs one decode-heavy round (``kvplug bench e2e``'s no-prefix workload: random prompts, every
request generating the same number of tokens) through ``generate_batch`` on kvplug, once to warm
up and once timed, and reports per step:

- the median time from one step's start to the next (``prepare_next_batch`` calls): what a decode
  step costs through the host, whatever overlaps inside it;
- the wall time of transformers' phases, timed around its own methods in the generation thread
  (``prepare_next_batch``: scheduling and batch tensors; ``compute_batch``: forward and sampler,
  or kvplug's graph replay; ``retrieve_device_outputs``; ``update_batch``);
- with ``--torch-profile``, the CUDA runtime calls that make the host wait for the device
  (stream / event / device synchronisations, blocking copies) and the device's busy time.

Usage (GPU): ``python benchmarks/profile_host_loop.py --concurrency 64 --requests 128``.
A diagnostic, not a benchmark with bars: the timers and the profiler cost host time themselves.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import torch


def _timed(owner: type, name: str, totals: dict, counts: dict, starts: list | None = None) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        if starts is not None:
            starts.append(start)
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
            counts[name] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=144)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--attention", default="triton")
    parser.add_argument("--variant", default="radix", help="a kvplug prefix cache, ':sync' / ':eager' suffixes as in bench e2e")
    parser.add_argument("--torch-profile", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run on the tiny shape")
    args = parser.parse_args()

    from transformers.generation.continuous_batching import continuous_api, model_runner

    from kvplug.bench.e2e_runner import RunConfig
    from kvplug.bench.e2e_workloads import Workload
    from kvplug_transformers.e2e_bench import VariantRunner, build_model

    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    model = build_model("qwen3-0.6b" if on_cuda else "qwen3-tiny", device, torch.bfloat16 if on_cuda else torch.float32)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, model.config.vocab_size, (args.prompt_tokens,), generator=generator).tolist() for _ in range(args.requests)]
    workload = Workload(name="no-prefix", first_round=prompts, rounds=1, next_round=None)
    max_seq_len = args.prompt_tokens + args.output_tokens + 16
    pages = -(-max_seq_len // 16) * args.concurrency + 64
    config = RunConfig(concurrency=args.concurrency, page_size=16, num_pages=pages, max_seq_len=max_seq_len,
                       max_batch_tokens=8192, output_tokens=args.output_tokens, attention=args.attention)
    runner = VariantRunner(model, args.variant, config)
    runner.run(workload)  # warm-up: capture, kernels, allocator

    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    processor = continuous_api.ContinuousBatchProcessor
    step_starts: list[float] = []
    _timed(processor, "prepare_next_batch", totals, counts, step_starts)
    _timed(processor, "update_batch", totals, counts)
    _timed(model_runner.ModelRunner, "compute_batch", totals, counts)
    for io_class in (continuous_api.ContinuousBatchingIOs, continuous_api.ContinuousBatchingAsyncIOs):
        _timed(io_class, "retrieve_device_outputs", totals, counts)
        _timed(io_class, "get_model_kwargs", totals, counts)

    profiler = None
    if args.torch_profile:
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else []))
        profiler.__enter__()
    start = time.perf_counter()
    figures = runner.run(workload)
    wall = time.perf_counter() - start
    if profiler is not None:
        profiler.__exit__(None, None, None)

    steps = max(counts["update_batch"], 1)
    intervals = sorted(b - a for a, b in zip(step_starts, step_starts[1:]))
    median = intervals[len(intervals) // 2] * 1e3 if intervals else float("nan")
    print(f"{args.variant} c{args.concurrency}: {figures['output_tok_per_s']:.0f} out tok/s, {steps} steps; "
          f"a step every {median:.2f} ms (median interval between step starts; decode steps are the bulk)")
    for name in sorted(totals, key=totals.get, reverse=True):
        print(f"  {name:26s} {totals[name] / steps * 1e3:7.3f} ms/step  ({counts[name]} calls)")
    if profiler is not None:
        events = profiler.key_averages()
        waits = [e for e in events if any(k in e.key for k in ("Synchronize", "cudaMemcpy", "cudaStreamWait", "Query"))]
        print("CUDA runtime calls that may wait (count, host ms total):")
        for e in sorted(waits, key=lambda e: e.cpu_time_total, reverse=True)[:12]:
            print(f"  {e.key:40s} {e.count:8d} {e.cpu_time_total / 1e3:10.1f}")
        device_ms = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
        print(f"device busy (kernels + copies): {device_ms:.0f} ms of {wall * 1e3:.0f} ms wall ({device_ms / wall / 10:.0f} %)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=15))
        print(events.table(sort_by="self_device_time_total", row_limit=25))


if __name__ == "__main__":
    main()
