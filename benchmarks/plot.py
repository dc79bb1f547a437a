"""Plots for BENCHMARKS.md (matplotlib, Agg backend; ``pip install matplotlib``).

    python benchmarks/plot.py --e2e e2e_cpu.json [--out-dir benchmarks/plots]

Writes:

- ``e2e_throughput_vs_concurrency.png``: output tokens/s and TTFT p50 of the shared-prefix
  workload against concurrency, one line per variant, from a ``kvplug bench e2e`` JSON;
- ``h200_bandwidth.png``: the H200 bandwidth figures of the attention benchmark (session of
  2026-11-29). They were reported as ranges over all measured shapes, not per context length, so
  the plot shows those ranges next to the copy bandwidth instead of a curve over context;
- ``h200_graph_step.png``: eager vs CUDA-graph decode step of the 28-layer stack.

The H200 figures below are the reported ones, copied; nothing is interpolated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

VARIANT_STYLE = {"radix": ("tab:blue", "o"), "naive": ("tab:orange", "s"), "native": ("tab:green", "^")}
# H200, 2026-11-29, bf16, 16 q / 8 kv heads, dim 128 (attention benchmark)
H200_COPY_TBS = (4.25, 4.28)
H200_TRITON_DECODE_TBS = (3.74, 4.09)  # over every measured shape
H200_STORE_KV_PERCENT = {"Triton store_kv\n16k-token prefill": (92.7, (86.0, 98.8)), "torch indexing\nstore": (19.0, None)}
# eager -> CUDA graph, us per decode step, 28 layers, context 1024
H200_GRAPH_STEP_US = {
    "triton": {1: (5162, 783), 8: (5544, 1252), 64: (5589, 2924)},
    "flashinfer": {1: (5054, 1166), 8: (5468, 1508), 64: (5388, 3322)},
}


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


def plot_h200_bandwidth(path: Path) -> None:
    figure, (tbs_axis, percent_axis) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 1.2]})
    tbs_axis.axhspan(*H200_COPY_TBS, color="grey", alpha=0.35, label=f"D2D copy {H200_COPY_TBS[0]}-{H200_COPY_TBS[1]} TB/s")
    low, high = H200_TRITON_DECODE_TBS
    tbs_axis.bar(["triton decode\n(range over all shapes)"], [high - low], bottom=[low], width=0.4, color="tab:blue",
                 label=f"triton decode {low}-{high} TB/s")
    tbs_axis.set_ylim(0, 4.6)
    tbs_axis.set_ylabel("TB/s of KV read")
    tbs_axis.legend(loc="lower right", fontsize=8)
    tbs_axis.set_title("decode attention vs copy bandwidth", fontsize=10)
    names = list(H200_STORE_KV_PERCENT)
    values = [H200_STORE_KV_PERCENT[name][0] for name in names]
    percent_axis.bar(names, values, width=0.5, color=["tab:blue", "tab:red"])
    for index, name in enumerate(names):
        spread = H200_STORE_KV_PERCENT[name][1]
        if spread:
            percent_axis.vlines(index, *spread, color="black", lw=1.5, label="other runs")
        percent_axis.text(index + 0.04, values[index] + 2, f"{values[index]:g} %", ha="left")
    percent_axis.axhline(100, color="grey", ls="--", label="copy bandwidth (same run)")
    percent_axis.axhline(80, color="tab:green", ls=":", label="SPEC bar 80 %")
    percent_axis.set_ylim(0, 115)
    percent_axis.set_ylabel("% of D2D copy bandwidth")
    percent_axis.set_title("store_kv", fontsize=10)
    percent_axis.legend(loc="upper right", fontsize=8)
    figure.suptitle("H200, 2026-11-29, bf16, 16 q / 8 kv heads, dim 128. Reported as ranges over shapes:\n"
                    "no per-context-length figures were reported, so no bandwidth-vs-context curve is drawn",
                    fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_h200_graph_step(path: Path) -> None:
    figure, axis = plt.subplots(figsize=(8, 4.2))
    sizes = sorted(next(iter(H200_GRAPH_STEP_US.values())))
    width, offset = 0.2, 0
    for backend, points in H200_GRAPH_STEP_US.items():
        for mode, shade in ((0, 0.45), (1, 1.0)):
            positions = [index + offset for index in range(len(sizes))]
            label = f"{backend} {'eager' if mode == 0 else 'CUDA graph'}"
            color = "tab:blue" if backend == "triton" else "tab:purple"
            bars = axis.bar(positions, [points[size][mode] for size in sizes], width, color=color, alpha=shade, label=label)
            axis.bar_label(bars, fontsize=7)
            offset += width
    axis.set_xticks([index + 1.5 * width for index in range(len(sizes))], [f"bs {size}" for size in sizes])
    axis.set_ylabel("µs per decode step")
    axis.set_title("H200, 2026-11-29: 28-layer Qwen3-0.6B-shaped stack, context 1024, eager vs CUDA graph", fontsize=10)
    axis.set_ylim(0, 7200)
    axis.legend(fontsize=8, ncol=2, loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--e2e", metavar="FILE.json", help="a kvplug bench e2e result (skipped if absent)")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "plots"))
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if args.e2e:
        plot_e2e(json.loads(Path(args.e2e).read_text()), out_dir / "e2e_throughput_vs_concurrency.png")
        written.append("e2e_throughput_vs_concurrency.png")
    plot_h200_bandwidth(out_dir / "h200_bandwidth.png")
    plot_h200_graph_step(out_dir / "h200_graph_step.png")
    written += ["h200_bandwidth.png", "h200_graph_step.png"]
    print("wrote " + ", ".join(str(out_dir / name) for name in written))


if __name__ == "__main__":
    main()
