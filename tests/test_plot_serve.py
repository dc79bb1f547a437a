"""``benchmarks/plot_serve.py`` on ``kvplug bench serve`` results: one SVG point per side per file, placed by value."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "plot_serve.py"
FIXTURE = REPO / "tests" / "fixtures" / "serve_result.json"
SVG = "{http://www.w3.org/2000/svg}"


def plot(tmp_path: Path, files: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, files), "--out", str(tmp_path / "serve.svg")],
                          capture_output=True, text=True, timeout=60)


def sweep(tmp_path: Path, levels: tuple[int, ...]) -> list[Path]:
    """The fixture at several concurrencies, kvplug's throughput rising and its TTFT falling with it."""
    base = json.loads(FIXTURE.read_text())
    files = []
    for level in levels:
        data = copy.deepcopy(base)
        data["settings"]["max_concurrency"] = level
        data["sides"][0]["output_throughput"] *= level / levels[0]
        data["sides"][0]["ttft_ms"]["p50"] /= level / levels[0]
        files.append(tmp_path / f"serve_c{level}.json")
        files[-1].write_text(json.dumps(data))
    return files


def circles(svg: Path, kind: str) -> list[ET.Element]:
    return [c for c in ET.parse(svg).getroot().iter(f"{SVG}circle") if c.get("class") == kind]


def test_the_fixture_gives_one_point_per_side_in_each_panel(tmp_path):
    done = plot(tmp_path, [FIXTURE])
    assert done.returncode == 0, done.stderr
    sides = json.loads(FIXTURE.read_text())["sides"]
    for kind in ("output_throughput", "ttft_p50_ms"):
        points = circles(tmp_path / "serve.svg", kind)
        assert len(points) == len(sides)
        assert {p.get("data-concurrency") for p in points} == {"8"}
    values = {p.get("data-side"): float(p.get("data-value")) for p in circles(tmp_path / "serve.svg", "output_throughput")}
    assert values == {side["name"]: side["output_throughput"] for side in sides}


def test_a_sweep_places_every_point_by_concurrency_and_value(tmp_path):
    levels = (4, 16, 64)
    done = plot(tmp_path, sweep(tmp_path, levels))
    assert done.returncode == 0, done.stderr
    svg = tmp_path / "serve.svg"
    for kind in ("output_throughput", "ttft_p50_ms"):
        points = circles(svg, kind)
        assert len(points) == 2 * len(levels)  # 2 sides per file
        kvplug = sorted((p for p in points if "triton" in p.get("data-side")), key=lambda p: int(p.get("data-concurrency")))
        assert [int(p.get("data-concurrency")) for p in kvplug] == list(levels)
        xs = [float(p.get("cx")) for p in kvplug]
        assert xs[0] < xs[1] < xs[2] and abs((xs[1] - xs[0]) - (xs[2] - xs[1])) < 0.5  # log2 axis: 4x apart, equal steps
        ys = [float(p.get("cy")) for p in kvplug]
        # SVG y grows downwards: rising throughput climbs, falling TTFT descends
        assert ys[0] > ys[1] > ys[2] if kind == "output_throughput" else ys[0] < ys[1] < ys[2]
    legend = " ".join(t.text or "" for t in ET.parse(svg).getroot().iter(f"{SVG}text"))
    assert "--attention triton" in legend and "--kv-backend native" in legend and "./model" not in legend


def test_files_of_different_workloads_are_refused(tmp_path):
    first, second = sweep(tmp_path, (4, 16))
    data = json.loads(second.read_text())
    data["settings"]["no_stream"] = True
    second.write_text(json.dumps(data))
    done = plot(tmp_path, [first, second])
    assert done.returncode == 2 and "no_stream" in done.stderr
    assert not (tmp_path / "serve.svg").exists()


def test_a_file_that_is_not_a_serve_result_is_refused(tmp_path):
    other = tmp_path / "e2e.json"
    other.write_text(json.dumps({"suite": "e2e", "schema": 1, "results": []}))
    done = plot(tmp_path, [other])
    assert done.returncode == 2 and "suite 'serve'" in done.stderr and "'e2e'" in done.stderr


def test_a_side_with_every_request_failed_is_refused(tmp_path):
    data = json.loads(FIXTURE.read_text())
    data["sides"][1]["ttft_ms"]["p50"] = float("nan")
    data["sides"][1]["failed"] = data["sides"][1]["requests"]
    broken = tmp_path / "failed.json"
    broken.write_text(json.dumps(data))
    done = plot(tmp_path, [broken])
    assert done.returncode == 2 and "no measured TTFT" in done.stderr
