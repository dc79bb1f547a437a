"""Output throughput and TTFT p50 against concurrency from ``kvplug bench serve`` results, as SVG.

    python benchmarks/plot_serve.py RESULT.json [RESULT.json ...] [--out benchmarks/plots/serve_concurrency.svg]

Each RESULT.json is one ``kvplug bench serve --out`` run, made at one ``--max-concurrency``; each of
its sides (one per ``--serve-args``, or the ``--base-url``) is one point in each panel, and the
points of a side are joined in order of concurrency. A sweep, for example:

    for c in 16 64 256; do
      kvplug bench serve --serve-args "MODEL" --serve-args "MODEL --kv-backend native" \\
          --dataset multi-turn --max-concurrency $c --out serve_c$c.json
    done
    python benchmarks/plot_serve.py serve_c*.json

Every point is a measured one; nothing is interpolated. The files must share one workload: a
different dataset, output length or streaming mode is refused. The standard library writes the
SVG by hand, so the script runs without matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple
from xml.sax.saxutils import escape, quoteattr

# Settings that must agree across files: points with different ones measure different workloads.
SAME_WORKLOAD = ("dataset", "no_stream", "output_tokens", "system_chars", "question_chars", "turns", "request_rate")
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
PANEL_W, PANEL_H, MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 420, 300, 70, 20, 40, 50
LEGEND_LINE = 18
DEFAULT_OUT = Path(__file__).parent / "plots" / "serve_concurrency.svg"


class ServeResultError(ValueError):
    """A file that is not a usable ``kvplug bench serve`` result, or files of different workloads."""


class ServePoint(NamedTuple):
    """One side of one result file."""

    side: str
    concurrency: int
    output_throughput: float  # output tokens per second
    ttft_p50_ms: float
    source: str  # the file it came from


def load_points(paths: list[Path]) -> list[ServePoint]:
    """Every side of every file, checked: a serve result of one shared workload, each side measured."""
    if not paths:
        raise ServeResultError("expected at least one `kvplug bench serve` JSON file, got none")
    points: list[ServePoint] = []
    reference: tuple[Path, dict] | None = None
    for path in paths:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("suite") != "serve" or data.get("schema") != 1:
            raise ServeResultError(f"{path}: expected a `kvplug bench serve` result (suite 'serve', schema 1), "
                                   f"got suite {data.get('suite') if isinstance(data, dict) else type(data).__name__!r}")
        settings = data.get("settings", {})
        concurrency = settings.get("max_concurrency")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ServeResultError(f"{path}: expected settings.max_concurrency >= 1, got {concurrency!r}")
        if reference is None:
            reference = (path, settings)
        for key in SAME_WORKLOAD:
            if settings.get(key) != reference[1].get(key):
                raise ServeResultError(f"{path}: {key} = {settings.get(key)!r}, but {reference[0]} has "
                                       f"{reference[1].get(key)!r}; one plot takes one workload")
        sides = data.get("sides") or []
        if not sides:
            raise ServeResultError(f"{path}: expected at least one side, got none")
        for side in sides:
            try:
                throughput, ttft = float(side["output_throughput"]), float(side["ttft_ms"]["p50"])
            except (KeyError, TypeError, ValueError) as error:
                raise ServeResultError(f"{path}: expected each side to have output_throughput and ttft_ms.p50, "
                                       f"got {sorted(side) if isinstance(side, dict) else side!r}") from error
            if not (math.isfinite(throughput) and math.isfinite(ttft)):
                raise ServeResultError(f"{path}: side {side['name']!r} has no measured TTFT or throughput "
                                       f"({side.get('failed')} of {side.get('requests')} requests failed)")
            points.append(ServePoint(" ".join(str(side["name"]).split()), concurrency, throughput, ttft, str(path)))
    return points


def side_labels(sides: list[str]) -> dict[str, str]:
    """Each side's words after those every side starts with (the shared model path, common flags)."""
    if len(sides) < 2:
        return {side: side or "server" for side in sides}
    words = [side.split() for side in sides]
    common = 0
    while all(len(w) > common for w in words) and len({w[common] for w in words}) == 1:
        common += 1
    return {side: " ".join(w[common:]) or "(defaults)" for side, w in zip(sides, words)}


def _ticks(high: float) -> list[float]:
    """0 and round steps up to at least ``high``."""
    if high <= 0:
        return [0.0, 1.0]
    raw = high / 5
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [step * i for i in range(int(math.ceil(high / step)) + 1)]


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 or value == int(value) else f"{value:.3g}"


def _panel(points: list[ServePoint], value: str, title: str, x0: float, sides: list[str]) -> list[str]:
    levels = sorted({point.concurrency for point in points})
    low, high = math.log2(levels[0]), math.log2(levels[-1])

    def x(level: int) -> float:
        if high == low:
            return x0 + MARGIN_L + (PANEL_W - MARGIN_L - MARGIN_R) / 2
        return x0 + MARGIN_L + (math.log2(level) - low) / (high - low) * (PANEL_W - MARGIN_L - MARGIN_R)

    ticks = _ticks(max(getattr(point, value) for point in points))
    top = ticks[-1]

    def y(amount: float) -> float:
        return MARGIN_T + (1 - amount / top) * (PANEL_H - MARGIN_T - MARGIN_B)

    left, right, bottom = x0 + MARGIN_L, x0 + PANEL_W - MARGIN_R, PANEL_H - MARGIN_B
    out = [f'<text x="{x0 + PANEL_W / 2:.1f}" y="20" text-anchor="middle" font-weight="bold">{escape(title)}</text>',
           f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{MARGIN_T}" x2="{left}" y2="{bottom}" stroke="black"/>',
           f'<text x="{(left + right) / 2:.1f}" y="{PANEL_H - 12}" text-anchor="middle">concurrency (requests in flight)</text>']
    for tick in ticks:
        out.append(f'<line x1="{left}" y1="{y(tick):.1f}" x2="{right}" y2="{y(tick):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{_number(tick)}</text>')
    for level in levels:
        out.append(f'<text x="{x(level):.1f}" y="{bottom + 16}" text-anchor="middle">{level}</text>')
    for index, side in enumerate(sides):
        color = COLORS[index % len(COLORS)]
        mine = sorted((point for point in points if point.side == side), key=lambda point: point.concurrency)
        path = " ".join(f"{x(point.concurrency):.1f},{y(getattr(point, value)):.1f}" for point in mine)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for point in mine:
            out.append(f'<circle class="{value}" cx="{x(point.concurrency):.1f}" cy="{y(getattr(point, value)):.1f}" '
                       f'r="4" fill="{color}" data-side={quoteattr(side)} data-concurrency="{point.concurrency}" '
                       f'data-value="{getattr(point, value):.3f}"><title>{escape(side)}: {point.concurrency} in flight, '
                       f'{getattr(point, value):,.1f}</title></circle>')
    return out


def render_svg(points: list[ServePoint], title: str = "") -> str:
    """Two panels, output tok/s and TTFT p50 (ms) against concurrency on a log2 axis, one line per side."""
    sides = list(dict.fromkeys(point.side for point in points))
    labels = side_labels(sides)
    legend_h = LEGEND_LINE * len(sides) + 10
    width, height = 2 * PANEL_W, PANEL_H + legend_h + (24 if title else 0)
    body = _panel(points, "output_throughput", "output tokens/s", 0, sides)
    body += _panel(points, "ttft_p50_ms", "TTFT p50 (ms)", PANEL_W, sides)
    for index, side in enumerate(sides):
        line_y = PANEL_H + 6 + LEGEND_LINE * index
        color = COLORS[index % len(COLORS)]
        body.append(f'<rect x="{MARGIN_L}" y="{line_y}" width="12" height="12" fill="{color}"/>')
        body.append(f'<text x="{MARGIN_L + 18}" y="{line_y + 10}">{escape(labels[side][:110])}</text>')
    if title:
        body.append(f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">{escape(title)}</text>')
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                      f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
                      f'<rect width="{width}" height="{height}" fill="white"/>', *body, "</svg>", ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="`kvplug bench serve --out` JSON files")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--title", default="", help="a caption under the panels (machine, date, commit)")
    args = parser.parse_args(argv)
    try:
        points = load_points(args.results)
    except ServeResultError as error:
        print(f"plot_serve: {error}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render_svg(points, args.title))
    print(f"wrote {args.out}: {len(points)} points, {len({p.side for p in points})} sides, "
          f"concurrency {sorted({p.concurrency for p in points})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
