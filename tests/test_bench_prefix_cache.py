"""Smoke test of ``kvplug bench prefix-cache --quick`` and of the bench CLI's suite discovery.

Timings are never asserted (benchmarks are not timed tests); the JSON shape and the work done are.
"""

from __future__ import annotations

import json

import pytest

from kvplug.bench import discover_suites
from kvplug.cli import main


def test_prefix_cache_suite_writes_the_documented_json(tmp_path, capsys):
    out = tmp_path / "prefix_cache.json"
    assert main(["bench", "prefix-cache", "--quick", "--page-sizes", "1,4", "--no-sglang", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["suite"] == "prefix-cache" and data["schema"] == 1 and data["quick"] is True
    assert data["environment"]["sglang"] is None and data["environment"]["sglang_missing"] == "disabled by --no-sglang"
    assert data["speedups"] == []
    rows = {(row["workload"], row["page_size"], row["operation"], row["cache"]): row for row in data["results"]}
    expected_operations = {
        "shared-prefix": ("match+lock", "indices", "insert"),
        "conversation": ("match+lock", "insert"),
        "evict": ("evict",),
    }
    assert set(rows) == {
        (workload, page_size, operation, "kvplug-radix")
        for workload, operations in expected_operations.items()
        for page_size in (1, 4)
        for operation in operations
    }
    sizes = data["sizes"]
    for row in rows.values():
        assert row["n"] > 0 and 0 < row["p50_us"] <= row["p99_us"], row
    for page_size in (1, 4):
        shared = rows[("shared-prefix", page_size, "match+lock", "kvplug-radix")]
        requests = sizes["requests"]
        assert shared["n"] == requests  # every request but the first hits the whole shared prefix
        assert shared["hit_tokens_mean"] == pytest.approx(sizes["shared"] * (requests - 1) / requests, abs=page_size)
        evict = rows[("evict", page_size, "evict", "kvplug-radix")]
        assert evict["n"] == sizes["evict_calls"] and evict["freed_tokens_mean"] >= sizes["evict_tokens"]
    assert [bar["met"] for bar in data["bars"]] == [False] * len(data["bars"])  # quick sizes never claim a bar
    assert "shared-prefix" in capsys.readouterr().out


def test_suites_are_discovered_by_their_suite_attribute():
    suites, failures = discover_suites()
    assert "prefix-cache" in suites and not failures
    for name, module in suites.items():
        assert module.SUITE == name and callable(module.run)


def test_a_cuda_suite_is_skipped_cleanly_without_cuda(tmp_path, monkeypatch, capsys):
    from kvplug.bench import prefix_cache
    from kvplug.cli import bench

    monkeypatch.setattr(prefix_cache, "REQUIRES_CUDA", True, raising=False)
    monkeypatch.setattr(bench, "_cuda_available", lambda: False)
    out = tmp_path / "skipped.json"
    assert main(["bench", "prefix-cache", "--quick", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == {"suite": "prefix-cache", "skipped": "needs a CUDA device; none is available"}
    assert "skipped" in capsys.readouterr().out


def test_bench_without_a_suite_prints_help(capsys):
    assert main(["bench"]) == 2
    assert "prefix-cache" in capsys.readouterr().out


def test_a_baseline_copy_of_the_prefix_caches_runs_beside_in_the_same_process(tmp_path):
    """``--baseline DIR`` loads another version's radix under a private name (here: this version's own
    files), so both versions are timed in one run; the current modules stay the ones in use."""
    import pathlib
    import shutil

    import kvplug.prefix_cache
    from kvplug.prefix_cache.radix import RadixPrefixCache

    copy = tmp_path / "prefix_cache"
    shutil.copytree(pathlib.Path(kvplug.prefix_cache.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "baseline.json"
    assert main(["bench", "prefix-cache", "--quick", "--page-sizes", "4", "--no-sglang", "--baseline", str(copy),
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    caches = {row["cache"] for row in data["results"]}
    assert caches == {"kvplug-radix", "baseline-radix"}
    assert {(row["workload"], row["operation"]) for row in data["versus_baseline"]} == {
        ("shared-prefix", "match+lock"), ("shared-prefix", "indices"), ("shared-prefix", "insert"),
        ("conversation", "match+lock"), ("conversation", "insert"), ("evict", "evict"),
    }
    hits = {row["cache"]: row["hit_tokens_mean"] for row in data["results"] if row["operation"] == "match+lock"
            and row["workload"] == "shared-prefix"}
    assert hits["kvplug-radix"] == hits["baseline-radix"]  # both did the same work
    assert not list(copy.glob("__pycache__/*"))  # the rewritten modules leave no bytecode behind
    assert kvplug.prefix_cache.radix.RadixPrefixCache is RadixPrefixCache


def test_checked_variant_runs_radix_behind_the_checks_with_the_same_work(tmp_path):
    """``--checked`` (issue 32): each cache also behind ``CheckedPrefixCache``; same hits, same sizes."""
    out = tmp_path / "checked.json"
    assert main(["bench", "prefix-cache", "--quick", "--page-sizes", "4", "--no-sglang", "--checked",
                 "--out", str(out)]) == 0
    rows = {(row["workload"], row["operation"], row["cache"]): row for row in json.loads(out.read_text())["results"]}
    for workload, operation in (("shared-prefix", "match+lock"), ("conversation", "insert"), ("evict", "evict")):
        plain, checked = rows[(workload, operation, "kvplug-radix")], rows[(workload, operation, "kvplug-radix+checked")]
        assert checked["n"] == plain["n"] > 0
        for fact in ("hit_tokens_mean", "cached_tokens", "freed_tokens_mean"):
            assert checked.get(fact) == plain.get(fact), (workload, fact)


def test_repeated_runs_report_the_median_run_and_its_spread(tmp_path):
    out = tmp_path / "repeated.json"
    assert main(["bench", "prefix-cache", "--quick", "--page-sizes", "1", "--no-sglang", "--repeat", "3",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {(row["workload"], row["operation"]): row for row in data["results"]}
    shared = rows[("shared-prefix", "match+lock")]
    assert shared["runs"] == 3 and shared["n"] == 3 * data["sizes"]["requests"]
    for row in rows.values():
        assert row["runs"] == 3 and row["p50_low_us"] <= row["p50_us"] <= row["p50_high_us"], row


def test_tensor_inputs_drive_the_public_methods(monkeypatch, tmp_path):
    """Default: kvplug's radix gets host arrays (as from the allocator); ``--tensor-inputs``: tensors."""
    from kvplug.prefix_cache.radix import RadixPrefixCache

    calls: set[str] = set()
    for name in ("match_prefix", "match_host", "insert_prefix", "insert_host"):
        original = getattr(RadixPrefixCache, name)
        monkeypatch.setattr(RadixPrefixCache, name,
                            lambda self, *args, name=name, original=original: calls.add(name) or original(self, *args))
    for flags, expected in (([], {"match_host", "insert_host"}), (["--tensor-inputs"], {"match_prefix", "insert_prefix"})):
        calls.clear()
        assert main(["bench", "prefix-cache", "--quick", "--page-sizes", "1", "--no-sglang", *flags,
                     "--out", str(tmp_path / "inputs.json")]) == 0
        assert calls == expected
