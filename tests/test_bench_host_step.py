"""Smoke test of ``kvplug bench host-step --quick``: the JSON it writes and the work it does.

Timings are never asserted (benchmarks are not timed tests); the shape of the results is.
"""

from __future__ import annotations

import json

from kvplug.bench import discover_suites
from kvplug.bench.host_step import CALL_PHASES, PHASES, STEP_PHASES, SUB_PHASES
from kvplug.cli import main


def test_host_step_suite_writes_every_phase_for_every_case(tmp_path, capsys):
    out = tmp_path / "host_step.json"
    args = ["bench", "host-step", "--quick", "--page-sizes", "1,4", "--batch-sizes", "1,3", "--repeats", "2",
            "--out", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["suite"] == "host-step" and data["schema"] == 1 and data["quick"] is True
    assert data["device"] == "cpu" and data["prefix_cache"] == "naive"
    steps = data["sizes"]["steps"]
    rows = {(row["bs"], row["page_size"], row["phase"]): row for row in data["results"]}
    phases = (*PHASES, "step", "calls_step", "calls_step_excl_input_ids", *SUB_PHASES)
    assert set(rows) == {(bs, page_size, phase) for bs in (1, 3) for page_size in (1, 4) for phase in phases}
    for (bs, page_size, phase), row in rows.items():
        if phase == "table_write" and page_size > 1:
            # a page is written only when a request crosses a page boundary: about every 4th step
            assert 0 < row["n"] < steps, row
        else:
            assert row["n"] == steps, row  # one call per decode step (page 1: a new page every step)
        assert 0 < row["p50_us"] <= row["p99_us"], row
    for bs in (1, 3):
        for page_size in (1, 4):
            for total, phases in (("step", STEP_PHASES), ("calls_step", CALL_PHASES)):
                parts = sum(rows[(bs, page_size, phase)]["min_us"] for phase in phases)
                assert rows[(bs, page_size, total)]["min_us"] >= parts * 0.99  # a step is its phases' sum
    assert data["bars"] == []  # the bar is for batch 256 only
    assert "calls_step_excl_input_ids" in capsys.readouterr().out


def test_host_step_is_a_discovered_suite():
    suites, failures = discover_suites()
    assert "host-step" in suites and not failures
