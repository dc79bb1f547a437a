"""Host-side timing helpers shared by the CPU benchmark suites."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np


def summarize_ns(samples_ns: Sequence[int]) -> dict[str, float]:
    """``{"n", "p50_us", "p99_us", "mean_us", "min_us"}`` of per-call durations in nanoseconds."""
    samples = np.asarray(samples_ns, dtype=np.float64) / 1e3
    if samples.size == 0:
        return {"n": 0, "p50_us": float("nan"), "p99_us": float("nan"), "mean_us": float("nan"), "min_us": float("nan")}
    return {
        "n": int(samples.size),
        "p50_us": round(float(np.percentile(samples, 50)), 3),
        "p99_us": round(float(np.percentile(samples, 99)), 3),
        "mean_us": round(float(samples.mean()), 3),
        "min_us": round(float(samples.min()), 3),
    }


@contextmanager
def gc_paused() -> Iterator[None]:
    """Collect now, then keep the cyclic GC out of the timed region (the same for every side)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """Right-aligned text table of ``rows`` restricted to ``columns``."""
    cells = [[str(column) for column in columns]] + [[_cell(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(line[index]) for line in cells) for index in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)
