"""Plots for BENCHMARKS.md (matplotlib, Agg backend; ``pip install matplotlib``).

    python benchmarks/plot.py --e2e e2e_cpu.json [--e2e e2e_h200.json] [--e2e-graphs E2E.json ...]
                              [--attention ATT.json] [--graphs GRAPHS.json] [--out-dir benchmarks/plots]

Writes:

- ``e2e_throughput_vs_concurrency.png`` (a CPU run) or ``e2e_h200_throughput_vs_concurrency.png``
  (a CUDA run): output tokens/s and TTFT p50 of the shared-prefix workload against concurrency,
  one line per variant, from a ``kvplug bench e2e`` JSON;
- ``e2e_h200_graphs_vs_eager.png``: output tokens/s of kvplug with its CUDA graphs, kvplug eager,
  naive and transformers' native cache, per workload and concurrency, from ``kvplug bench e2e``
  CUDA runs (``--e2e-graphs``, repeatable);
- ``h200_bandwidth.png``: decode attention bandwidth (KV bytes read per second of device time)
  against the KV tokens a step reads (batch × context), per implementation and page size, next to
  the device-to-device copy bandwidth measured in the same run, plus store_kv's share of it —
  from a ``kvplug bench attention`` JSON (default: the H200 run in benchmarks/results/);
- ``h200_graph_step.png``: eager vs CUDA-graph decode step of the 28-layer stack, from a
  ``kvplug bench graphs`` JSON (default: the H200 run in benchmarks/results/);
- ``host_tier_cpu.png`` / ``host_tier_h200.png`` (``--host-tier FILE.json``, repeatable): hit rate per tier and TTFT p50 of
  ``radix`` and ``radix+host`` against the working-set / pool ratio, from ``kvplug bench e2e
  --workloads long-context-chat --variants radix,radix+host --working-set-ratio 1,2,4,8`` runs;
- ``fleet_cpu.png`` (``--fleet FILE.json``): hit rate and TTFT p50/p99 per routing policy of a
  ``benchmarks/fleet.py`` run (N kvplug servers, random / round-robin / sticky / Dynamo routing).

Every point is a measured one from those files; nothing is interpolated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

VARIANT_STYLE = {"radix": ("tab:blue", "o"), "naive": ("tab:orange", "s"), "native": ("tab:green", "^"),
                 "radix:eager": ("tab:cyan", "D"), "radix:sync": ("tab:purple", "v")}
VARIANT_LABEL = {"radix": "kvplug radix, CUDA graphs + overlap", "radix:sync": "kvplug radix, CUDA graphs, no overlap",
                 "radix:eager": "kvplug radix, eager", "naive": "kvplug naive, CUDA graphs (+ overlap)",
                 "native": "transformers' native cache"}
RESULTS = Path(__file__).parent / "results"
DECODE_STYLE = {"flashinfer-direct": ("black", "x", "--"), "flashinfer": ("tab:purple", "o", "-"), "triton": ("tab:blue", "s", "-")}


def plot_e2e(data: dict, path: Path) -> None:
    rows = [row for row in data["results"] if row["workload"] == "shared-prefix"]
    model, env = data["model"], data["environment"]
    figure, (throughput_axis, ttft_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant in data["variants"]:
        points = sorted((row["concurrency"], row["output_tok_per_s"], row["ttft_p50_ms"])
                        for row in rows if row["variant"] == variant)
        if not points:
            continue
        color, marker = VARIANT_STYLE.get(variant, (None, "x"))
        levels = [point[0] for point in points]
        throughput_axis.plot(levels, [point[1] for point in points], marker=marker, color=color, label=variant)
        ttft_axis.plot(levels, [point[2] for point in points], marker=marker, color=color, label=variant)
    sizes = data["sizes"]
    for axis, label in ((throughput_axis, "output tokens / s"), (ttft_axis, "TTFT p50 (ms, from submission)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes["concurrency"], [str(level) for level in sizes["concurrency"]])
        axis.set_xlabel("concurrency (requests per step)")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    throughput_axis.set_ylim(bottom=0)
    ttft_axis.set_ylim(bottom=0)
    figure.suptitle(
        f"kvplug e2e, shared-prefix: {sizes['requests']} requests, {sizes['system_prompts']} x {sizes['system_tokens']}"
        f"-token system prompts, {sizes['question_tokens']}-token questions, {sizes['output_tokens']} output tokens\n"
        f"{model['shape']} {model['dtype']} on {model['device']} ({env['torch_threads']} torch thread(s)), "
        f"page {model['page_size']}, median of {data['repeats']} run(s)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _before_overlap_renamed(data: dict) -> dict:
    """Runs recorded before overlap scheduling existed (no ``:sync`` variant, kvplug 0.1.0.dev0
    before it) ran ``radix`` with graphs and without overlap: plot them as ``radix:sync``."""
    if "radix:sync" in data["variants"] or not data.get("before_overlap", False):
        return data
    renamed = [dict(row, variant="radix:sync") if row["variant"] == "radix" else row for row in data["results"]]
    return dict(data, results=renamed)


def plot_e2e_graphs(runs: list[dict], path: Path) -> None:
    """Output tokens/s per variant (kvplug with CUDA graphs, kvplug eager, naive, native), one
    group per workload and concurrency, from ``kvplug bench e2e --device cuda`` runs."""
    runs = [_before_overlap_renamed(data) for data in runs]
    groups = [(data, workload, level) for data in runs
              for workload, level in sorted({(row["workload"], row["concurrency"]) for row in data["results"]})]
    variants = [name for name in ("radix", "radix:sync", "radix:eager", "naive", "native")
                if any(row["variant"] == name for data in runs for row in data["results"])]
    figure, axis = plt.subplots(figsize=(11, 4.6))
    width = 0.8 / len(variants)
    for index, variant in enumerate(variants):
        values = []
        for data, workload, level in groups:
            row = next((row for row in data["results"] if (row["workload"], row["concurrency"], row["variant"])
                        == (workload, level, variant)), None)
            values.append(row["output_tok_per_s"] if row else 0)
        bars = axis.bar([group + index * width for group in range(len(groups))], values, width,
                        color=VARIANT_STYLE[variant][0], label=VARIANT_LABEL[variant])
        axis.bar_label(bars, fmt="%.0f", fontsize=7, rotation=90, padding=2)
    labels = [f"{workload}\nconcurrency {level}\n{data['sizes']['output_tokens']} output tokens"
              for data, workload, level in groups]
    axis.set_xticks([group + width * (len(variants) - 1) / 2 for group in range(len(groups))], labels, fontsize=8)
    axis.set_ylabel("output tokens / s")
    axis.set_yscale("log")
    axis.set_ylim(100, max(row["output_tok_per_s"] for data in runs for row in data["results"]) * 4)
    axis.legend(fontsize=8, loc="upper left")
    model = runs[0]["model"]
    axis.set_title(f"H200, kvplug bench e2e: {model['shape']} {model['dtype']}, attention {model['attention']}, "
                   f"page {model['page_size']}; one run each after a warm-up per variant", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_h200_bandwidth(data: dict, path: Path) -> None:
    copy_tbs = data["copy_TB/s"]
    pages = sorted({row["page"] for row in data["decode"]})
    figure, axes = plt.subplots(1, len(pages) + 1, figsize=(5 * len(pages) + 4, 4.2))
    for axis, page in zip(axes, pages):
        for impl, (color, marker, style) in DECODE_STYLE.items():
            rows = sorted((row for row in data["decode"] if row["page"] == page and row["impl"] == impl),
                          key=lambda row: row["bs"] * row["ctx"])
            if rows:
                axis.plot([row["bs"] * row["ctx"] for row in rows], [row["TB/s"] for row in rows], style,
                          color=color, marker=marker, label=impl)
        axis.axhline(copy_tbs, color="grey", ls=":", label=f"D2D copy {copy_tbs} TB/s (same run)")
        axis.set_xscale("log", base=2)
        shapes = sorted({(row["bs"], row["ctx"]) for row in data["decode"] if row["page"] == page}, key=lambda s: s[0] * s[1])
        axis.set_xticks([bs * ctx for bs, ctx in shapes], [f"{bs}×{ctx}" for bs, ctx in shapes], fontsize=8, rotation=35)
        axis.set_ylim(0, copy_tbs * 1.1)
        axis.set_xlabel("batch × context (KV tokens read per layer)")
        axis.set_ylabel("TB/s of KV read (CUDA-graph device time)")
        axis.set_title(f"decode attention, page size {page}", fontsize=10)
        axis.legend(fontsize=8, loc="lower right")
    store = data["store_kv"]
    names = ["Triton store_kv", "torch indexing"]
    values = [100 * store["triton_of_copy"], 100 * store["torch_index_of_copy"]]
    bar_axis = axes[-1]
    bar_axis.bar(names, values, width=0.5, color=["tab:blue", "tab:red"])
    for index, value in enumerate(values):
        bar_axis.text(index, value + 2, f"{value:.1f} %", ha="center")
    bar_axis.axhline(100, color="grey", ls=":", label="copy bandwidth (same run)")
    bar_axis.axhline(80, color="tab:green", ls="--", label="SPEC bar 80 %")
    bar_axis.set_ylim(0, 115)
    bar_axis.set_ylabel("% of D2D copy bandwidth")
    bar_axis.set_title(f"store_kv, {store['tokens']:,}-token prefill", fontsize=10)
    bar_axis.legend(fontsize=8, loc="upper right")
    figure.suptitle("H200, 2026-11-29, bf16, 16 q / 8 kv heads, head_dim 128 (kvplug bench attention)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_h200_graph_step(data: dict, path: Path) -> None:
    rows = data["decode_step"]
    backends = sorted({row["backend"] for row in rows}, reverse=True)
    sizes = sorted({row["bs"] for row in rows})
    figure, axis = plt.subplots(figsize=(8, 4.2))
    width, offset = 0.2, 0
    for backend in backends:
        points = {row["bs"]: row for row in rows if row["backend"] == backend}
        for key, shade in (("eager_us", 0.45), ("graph_us", 1.0)):
            label = f"{backend} {'eager' if key == 'eager_us' else 'CUDA graph'}"
            color = "tab:blue" if backend == "triton" else "tab:purple"
            bars = axis.bar([index + offset for index in range(len(sizes))], [points[size][key] for size in sizes],
                            width, color=color, alpha=shade, label=label)
            axis.bar_label(bars, fmt="%.0f", fontsize=7)
            offset += width
    axis.set_xticks([index + (offset - width) / 2 for index in range(len(sizes))], [f"bs {size}" for size in sizes])
    axis.set_ylabel("µs per decode step")
    axis.set_title("H200, kvplug bench graphs: 28-layer Qwen3-0.6B-shaped stack through KVBackend, context 1024, "
                   "eager vs CUDA graph", fontsize=10)
    axis.set_ylim(0, max(row["eager_us"] for row in rows) * 1.3)
    axis.legend(fontsize=8, ncol=2, loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_host_tier(runs: list[dict], path: Path) -> None:
    """Hit rate (device and host tier) and TTFT p50 against the working-set / pool ratio."""
    rows = [row for data in runs for row in data["results"] if "working_set_ratio" in row]
    figure, (hit_axis, ttft_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant, color in (("radix", "tab:blue"), ("radix+host", "tab:red")):
        points = sorted((row["working_set_ratio"], row["device_hit_rate"], row["host_hit_rate"], row["ttft_p50_ms"])
                        for row in rows if row["variant"] == variant)
        if not points:
            continue
        ratios = [point[0] for point in points]
        hit_axis.plot(ratios, [point[1] for point in points], marker="o", color=color, label=f"{variant}: device tier")
        if variant == "radix+host":
            hit_axis.plot(ratios, [point[1] + point[2] for point in points], marker="^", linestyle="--", color=color,
                          label=f"{variant}: device + host tier")
        ttft_axis.plot(ratios, [point[3] for point in points], marker="o", color=color, label=variant)
    for axis, label in ((hit_axis, "prompt tokens hit (fraction)"), (ttft_axis, "TTFT p50 (ms, from submission)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("working set / KV pool")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    hit_axis.set_ylim(0, 1)
    ttft_axis.set_ylim(bottom=0)
    data = runs[0]
    model, sizes = data["model"], data["sizes"]
    figure.suptitle(
        f"kvplug host-memory tier, long-context-chat: {sizes['conversations']} chats x {sizes['turns']} turns over "
        f"{sizes['system_tokens']}-token contexts\n{model['shape']} {model['dtype']} on {model['device']}, "
        f"page {model['page_size']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_fleet(data: dict, path: Path) -> None:
    """Hit rate and TTFT per routing policy of one ``benchmarks/fleet.py`` run."""
    rows = data["results"]
    names = [row["policy"] for row in rows]
    colors = ["tab:red" if name.startswith("dynamo") else "tab:green" if name == "sticky" else "tab:gray"
              for name in names]
    figure, (hit_axis, ttft_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    hit_axis.bar(names, [row["hit_rate"] for row in rows], color=colors)
    for number, row in enumerate(rows):
        hit_axis.text(number, row["hit_rate"] + 0.01, f"{row['hit_rate']:.2f}", ha="center", fontsize=9)
    hit_axis.set_ylabel("prompt tokens cached (fraction)")
    hit_axis.set_ylim(0, 1)
    positions = range(len(rows))
    ttft_axis.bar([p - 0.2 for p in positions], [row["ttft_p50_ms"] for row in rows], width=0.4, label="p50",
                  color=colors)
    ttft_axis.bar([p + 0.2 for p in positions], [row["ttft_p99_ms"] for row in rows], width=0.4, label="p99",
                  color=colors, alpha=0.45)
    ttft_axis.set_xticks(list(positions), names)
    ttft_axis.set_ylabel("TTFT (ms; p50 solid, p99 light)")
    for axis in (hit_axis, ttft_axis):
        axis.grid(True, axis="y", alpha=0.3)
    figure.suptitle(
        f"{data['workers']} kvplug serve workers ({data['model']} model, KV pool {data['kv_memory']} each), "
        f"{data['conversations']} chats x {data['turns']} turns, {data.get('concurrency', 1)} in flight, {data['cpus']} CPUs",
        fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--e2e", metavar="FILE.json", action="append", default=[],
                        help="a kvplug bench e2e result (repeatable; a CUDA run is drawn as e2e_h200_*.png)")
    parser.add_argument("--attention", default=str(RESULTS / "h200_attention.json"), help="a kvplug bench attention result")
    parser.add_argument("--graphs", default=str(RESULTS / "h200_graphs.json"), help="a kvplug bench graphs result")
    parser.add_argument("--e2e-graphs", metavar="FILE.json", action="append", default=[],
                        help="kvplug bench e2e CUDA runs with radix, radix:eager, naive and native variants "
                             "(repeatable; drawn together as e2e_h200_graphs_vs_eager.png)")
    parser.add_argument("--host-tier", metavar="FILE.json", action="append", default=[],
                        help="kvplug bench e2e long-context-chat runs of radix and radix+host (repeatable)")
    parser.add_argument("--fleet", metavar="FILE.json", help="a benchmarks/fleet.py result")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "plots"))
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for e2e_file in args.e2e:
        data = json.loads(Path(e2e_file).read_text())
        name = "e2e_h200_throughput_vs_concurrency.png" if data["model"]["device"].startswith("cuda") else \
            "e2e_throughput_vs_concurrency.png"
        plot_e2e(data, out_dir / name)
        written.append(name)
    if args.e2e_graphs:
        plot_e2e_graphs([json.loads(Path(name).read_text()) for name in args.e2e_graphs],
                        out_dir / "e2e_h200_graphs_vs_eager.png")
        written.append("e2e_h200_graphs_vs_eager.png")
    if args.host_tier:
        runs = [json.loads(Path(name).read_text()) for name in args.host_tier]
        name = "host_tier_h200.png" if runs[0]["model"]["device"].startswith("cuda") else "host_tier_cpu.png"
        plot_host_tier(runs, out_dir / name)
        written.append(name)
    if args.fleet:
        plot_fleet(json.loads(Path(args.fleet).read_text()), out_dir / "fleet_cpu.png")
        written.append("fleet_cpu.png")
    plot_h200_bandwidth(json.loads(Path(args.attention).read_text()), out_dir / "h200_bandwidth.png")
    plot_h200_graph_step(json.loads(Path(args.graphs).read_text()), out_dir / "h200_graph_step.png")
    written += ["h200_bandwidth.png", "h200_graph_step.png"]
    print("wrote " + ", ".join(str(out_dir / name) for name in written))


if __name__ == "__main__":
    main()
