"""kvplug's radix cache inside vLLM against vLLM's own automatic prefix caching (issue 26), on this machine.

    python benchmarks/vllm_prefix.py [--out vllm_prefix.json] [--host-memory 16MiB]
        [--shared-requests 12] [--conversations 16] [--repeats 2]

Run with vLLM's CPU build (``/tmp/vllm-venv/bin/python``). Three variants, each in its own
interpreter (a fresh ``LLM(...)`` engine, in-process EngineCore: vLLM keeps process-wide state):
``native`` (vLLM APC), ``radix`` (``KvplugConnector``, ``prefix_cache="radix"``) and ``radix+host``
(the same with ``host_memory``). Every variant gets one warm-up generate, then its prefix cache is
reset, then the same prompts (token ids) in the same order. ``--repeats`` runs every variant that many
times, the variants' order rotated each time (this machine's load drifts); the measured requests of
all repeats are pooled, and each repeat's p50 TTFT and tok/s are kept in the JSON:

- ``shared``: N requests sharing a 1,024-token system prompt with distinct 32-96 token questions;
  the first request alone, then the others together (a pool much larger than the workload).
- ``working-set``: K two-turn conversations (a 384-token head and a question, then the same plus a
  fixed reply and a second question) through a pool of 40 blocks of 128 tokens: every first turn,
  then every second turn, so the prefixes revisited were evicted from the pool before they return.

Per request: TTFT from vLLM's ``RequestOutput.metrics.first_token_latency`` (arrival to first token,
queueing included, stats logging on), cached tokens from ``num_cached_tokens``. Per variant: hit
rate (cached / prompt tokens), output tok/s over the measured ``generate`` calls. Greedy float32 on
a tiny random checkpoint (tests/vllm_models.py), so outputs are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
BLOCK = 128  # vLLM's CPU block size in tokens
KV_BYTES_PER_TOKEN = 1024  # the tiny checkpoint: 2 layers x K and V x 2 heads x 32 x float32
VARIANTS = ("native", "radix", "radix+host")
WORKLOADS = ("shared", "working-set")
TTFT_SOURCE = "RequestOutput.metrics.first_token_latency (arrival to first token, in-process engine)"


class Row(NamedTuple):
    """One variant on one workload, with its ratios to native vLLM on the same workload."""

    workload: str
    variant: str
    hit_rate: float
    ttft_p50_ms: float
    ttft_mean_ms: float
    out_tok_s: float
    ttft_ratio: float  # native's p50 TTFT / this one's: > 1 is faster
    tok_s_ratio: float  # this one's tok/s / native's
    identical: bool  # token ids equal native's for every request
    best_ttft_p50_ms: float  # the lowest p50 over the repeats: the least loaded run
    best_out_tok_s: float  # the highest tok/s over the repeats
    best_ttft_ratio: float  # native's best p50 / this one's
    best_tok_s_ratio: float  # this one's best tok/s / native's


def prompts(workload: str, count: int) -> list[list[list[int]]]:
    """The prompts as rounds of token-id lists (each round one ``generate`` call), fixed by a seed."""
    rng = random.Random(26)
    tokens = lambda n: [rng.randrange(256) for _ in range(n)]  # noqa: E731
    if workload == "shared":
        system = tokens(8 * BLOCK)
        questions = [system + tokens(rng.randrange(32, 97)) for _ in range(count)]
        return [questions[:1], questions[1:]]
    if workload == "working-set":
        heads = [tokens(3 * BLOCK) + tokens(rng.randrange(24, 57)) for _ in range(count)]
        return [heads, [head + tokens(64) + tokens(rng.randrange(24, 57)) for head in heads]]
    raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")


def pool(runs: list[dict]) -> dict:
    """One variant's repeats as one result: per-request lists concatenated, tokens and seconds summed."""
    merged = {key: [v for run in runs for v in run[key]] for key in ("tokens", "cached", "prompt_tokens", "ttft_s")}
    merged["output_tokens"] = sum(run["output_tokens"] for run in runs)
    merged["seconds"] = sum(run["seconds"] for run in runs)
    merged["repeats"] = [{"ttft_p50_ms": statistics.median(run["ttft_s"]) * 1e3,
                          "out_tok_s": run["output_tokens"] / run["seconds"]} for run in runs]
    return merged


def best(result: dict) -> tuple[float, float]:
    """The lowest p50 TTFT (ms) and highest tok/s over a pooled result's repeats (the pool itself without)."""
    repeats = result.get("repeats") or [{"ttft_p50_ms": statistics.median(result["ttft_s"]) * 1e3,
                                         "out_tok_s": result["output_tokens"] / result["seconds"]}]
    return min(r["ttft_p50_ms"] for r in repeats), max(r["out_tok_s"] for r in repeats)


def summarize(results: dict[str, dict[str, dict]]) -> list[Row]:
    """Rows per workload and variant from the workers' results ({workload: {variant: result}})."""
    rows = []
    for workload, by_variant in results.items():
        native = by_variant["native"]
        native_p50 = statistics.median(native["ttft_s"])
        native_tok_s = native["output_tokens"] / native["seconds"]
        native_best = best(native)
        for variant, result in by_variant.items():
            p50 = statistics.median(result["ttft_s"])
            tok_s = result["output_tokens"] / result["seconds"]
            rows.append(Row(workload, variant, sum(result["cached"]) / sum(result["prompt_tokens"]),
                            p50 * 1e3, statistics.fmean(result["ttft_s"]) * 1e3, tok_s,
                            native_p50 / p50, tok_s / native_tok_s, result["tokens"] == native["tokens"],
                            *best(result), native_best[0] / best(result)[0], best(result)[1] / native_best[1]))
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| workload | variant | hit rate | TTFT p50 ms | TTFT mean ms | out tok/s | TTFT x native | "
             "tok/s x native | best TTFT p50 ms (x native) | best tok/s (x native) | tokens = native |",
             "| --- " * 11 + "|"]
    for r in rows:
        lines.append(f"| {r.workload} | {r.variant} | {r.hit_rate:.1%} | {r.ttft_p50_ms:.1f} | {r.ttft_mean_ms:.1f} | "
                     f"{r.out_tok_s:.1f} | {r.ttft_ratio:.2f} | {r.tok_s_ratio:.2f} | {r.best_ttft_p50_ms:.1f} ({r.best_ttft_ratio:.2f}) | "
                     f"{r.best_out_tok_s:.1f} ({r.best_tok_s_ratio:.2f}) | {'yes' if r.identical else 'NO'} |")
    return "\n".join(lines)


def worker(model: str, workload: str, variant: str, count: int, host_memory: str, out: str) -> None:
    """One engine, one workload: warm-up, reset, the measured rounds; result JSON to ``out``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = dict(model=model, dtype="float32", max_model_len=2048, distributed_executor_backend="uni",
                  enable_prefix_caching=True, seed=0, enforce_eager=True, disable_log_stats=False, max_num_seqs=4)
    # shared: room for everything; working-set: 40 blocks, fewer than the conversations' prefixes
    pool_blocks = 512 if workload == "shared" else 40
    kwargs["kv_cache_memory_bytes"] = pool_blocks * BLOCK * KV_BYTES_PER_TOKEN
    if variant != "native":
        extra = {"prefix_cache": "radix", **({"host_memory": host_memory} if variant == "radix+host" else {})}
        kwargs["kv_transfer_config"] = KVTransferConfig(kv_connector="KvplugConnector", kv_role="kv_both",
                                                        kv_connector_extra_config=extra)
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    warm = random.Random(99)
    llm.generate([{"prompt_token_ids": [warm.randrange(256) for _ in range(300)]}], params, use_tqdm=False)
    if not llm.reset_prefix_cache():
        raise RuntimeError(f"{variant}: reset_prefix_cache() after the warm-up returned False")
    result = {"tokens": [], "cached": [], "prompt_tokens": [], "ttft_s": [], "output_tokens": 0, "seconds": 0.0,
              "pool_blocks": pool_blocks}
    for batch in prompts(workload, count):
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        result["seconds"] += time.perf_counter() - start
        for output in outputs:
            if output.metrics is None or not output.metrics.first_token_latency:
                raise RuntimeError(f"{variant}: RequestOutput.metrics has no first_token_latency")
            result["tokens"].append(list(output.outputs[0].token_ids))
            result["cached"].append(output.num_cached_tokens)
            result["prompt_tokens"].append(len(output.prompt_token_ids))
            result["ttft_s"].append(output.metrics.first_token_latency)
            result["output_tokens"] += len(output.outputs[0].token_ids)
    if variant != "native":
        result["kvplug"] = llm.llm_engine.engine_core.engine_core.scheduler.connector.snapshot()
    with open(out, "w") as handle:
        json.dump(result, handle)


def run_variant(model: Path, workload: str, variant: str, count: int, host_memory: str, scratch: Path) -> dict:
    out = scratch / f"{workload}-{variant}.json"
    path = [str(REPO), str(REPO / "adapters" / "vllm"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=os.pathsep.join(filter(None, path)))
    done = subprocess.run([sys.executable, __file__, "--worker", str(model), workload, variant, str(count), host_memory,
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{workload}/{variant} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        model, workload, variant, count, host_memory, out = sys.argv[2:8]
        worker(model, workload, variant, int(count), host_memory, out)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--host-memory", default="16MiB", help="kvplug's host tier in the radix+host variant")
    parser.add_argument("--shared-requests", type=int, default=12)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="runs of every variant, order rotated")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.vllm_models import build_model

    results: dict[str, dict[str, dict]] = {}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvplug-vllm-bench-") as scratch:
        model = build_model(Path(scratch) / "tiny-llama")
        for workload in WORKLOADS:
            count = args.shared_requests if workload == "shared" else args.conversations
            runs: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
            for repeat in range(args.repeats):
                for variant in VARIANTS[repeat % 3:] + VARIANTS[:repeat % 3]:
                    runs[variant].append(run_variant(model, workload, variant, count, args.host_memory,
                                                     Path(scratch)))
                    print(f"{workload}/{variant} #{repeat} done at {time.perf_counter() - began:.0f} s",
                          file=sys.stderr)
            results[workload] = {variant: pool(runs[variant]) for variant in VARIANTS}
    rows = summarize(results)
    print(f"TTFT: {TTFT_SOURCE}")
    print(f"{args.repeats} repeat(s) per variant, pooled; per repeat (p50 TTFT ms / out tok/s):")
    for workload, by_variant in results.items():
        for variant, result in by_variant.items():
            print(f"  {workload}/{variant}: " + ", ".join(f"{r['ttft_p50_ms']:.0f} / {r['out_tok_s']:.0f}"
                                                        for r in result["repeats"]))
    print(table(rows))
    print("token-identical to native vLLM:", all(r.identical for r in rows))
    if args.out:
        args.out.write_text(json.dumps({
            "ttft_source": TTFT_SOURCE, "host_memory": args.host_memory, "repeats": args.repeats, "rows": [r._asdict() for r in rows],
            "results": results, "seconds": time.perf_counter() - began,
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
