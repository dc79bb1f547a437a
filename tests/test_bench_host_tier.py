"""``kvplug bench e2e`` for the host-memory tier: the long-context-chat workload, its sizing against a
pool ``--working-set-ratio`` times smaller than its working set, the ``radix+host`` variant, the
tier ratios and bars, and the copy-bandwidth figure (timings are never asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from kvplug.bench.e2e import bars, ratios, run_config
from kvplug.bench.e2e_workloads import PRESETS, build_workload, working_set_tokens
from kvplug.bench.tier_copy import measure_copy_bandwidth

SIZES = PRESETS["quick"]


def test_long_context_chat_has_one_context_per_conversation_and_grows_by_turn():
    sizes = SIZES.updated(conversations=5, turns=3)
    workload = build_workload("long-context-chat", sizes, vocab=1000, seed=2)
    first = workload.first_round
    assert len(first) == 5 and all(len(prompt) == sizes.system_tokens + sizes.question_tokens for prompt in first)
    assert len({tuple(prompt[: sizes.system_tokens]) for prompt in first}) == 5
    answers = [[9] * sizes.output_tokens for _ in first]
    second = workload.next_round(1, first, answers)
    assert all(follow[: len(prompt)] == prompt for prompt, follow in zip(first, second))
    third = workload.next_round(2, second, answers)
    longest = sizes.system_tokens + sizes.chat_prompt_tokens
    assert max(map(len, third)) == longest
    assert working_set_tokens("long-context-chat", sizes) == 5 * (longest + sizes.output_tokens)


def test_tier_sizing_puts_the_working_set_at_the_ratio_over_the_pool():
    sizes = PRESETS["gpu"]
    workload = build_workload("long-context-chat", sizes, vocab=100, seed=0)
    config = run_config(sizes, workload, 256, 16, "auto", working_set_ratio=4.0, kv_bytes_per_token=1000)
    working = working_set_tokens("long-context-chat", sizes)
    assert abs(working / (config.num_pages * 16) - 4.0) < 0.01
    longest = sizes.system_tokens + sizes.chat_prompt_tokens + sizes.output_tokens
    assert config.max_seq_len >= longest and config.concurrency * config.max_seq_len <= config.num_pages * 16
    assert config.host_memory == int(1.25 * working) * 1000
    assert run_config(sizes, workload, 256, 16, "auto", host_memory=123).host_memory == 123


def test_tier_ratio_and_bars():
    rows = [{"workload": "long-context-chat", "concurrency": 8, "variant": variant, "output_tok_per_s": throughput,
             "ttft_p50_ms": ttft, "latency_p50_ms": ttft} for variant, throughput, ttft in
            (("radix", 100.0, 40.0), ("radix+host", 250.0, 15.0))]
    ratio_rows = ratios(rows)
    assert ratio_rows == [{"workload": "long-context-chat", "concurrency": 8, "ratio": "radix+host/radix",
                           "throughput": 2.5, "ttft_p50": 0.375, "latency_p50": 0.375}]
    verdicts = bars(ratio_rows, at_issue_sizes=False)
    assert [(verdict["bar"], verdict["met"]) for verdict in verdicts] == [
        ("radix+host/radix throughput >= 2.0", True), ("radix+host/radix TTFT p50 <= 0.5", True)]
    overhead = bars(ratio_rows, at_issue_sizes=False, tier_reuse=False)
    assert [(verdict["bar"], verdict["met"]) for verdict in overhead] == [
        ("radix+host/radix throughput >= 0.98 at 0 % hits", True)]


def test_copy_bandwidth_measures_both_directions_against_plain_copies():
    figures = measure_copy_bandwidth(2, 2, 8, torch.float32, torch.device("cpu"), 4, 16, repeats=1)
    assert figures["bytes"] == 16 * figures["page_bytes"] == 16 * 2 * 2 * 4 * 2 * 8 * 4
    for name in ("tier_write_gb_s", "plain_d2h_gb_s", "tier_load_gb_s", "plain_h2d_gb_s", "write_ratio", "load_ratio"):
        assert figures[name] > 0


def test_quick_tier_run_hits_host_memory_and_generates_the_same_tokens_at_each_ratio(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("kvplug_transformers")
    from kvplug.cli import main

    out = tmp_path / "tier.json"
    previous_threads = torch.get_num_threads()
    try:
        code = main(["bench", "e2e", "--quick", "--threads", "1", "--workloads", "long-context-chat",
                     "--variants", "radix,radix+host", "--conversations", "6", "--turns", "3",
                     "--working-set-ratio", "4,2", "--out", str(out)])
    finally:
        torch.set_num_threads(previous_threads)
    assert code == 0
    data = json.loads(out.read_text())
    assert {row["workload"] for row in data["results"]} == {"long-context-chat@4x", "long-context-chat@2x"}
    for ratio in (4, 2):
        rows = {row["variant"]: row for row in data["results"] if row["working_set_ratio"] == ratio}
        assert rows["radix"]["host_hit_rate"] == 0 and rows["radix"]["host_write_backs"] == 0
        assert rows["radix+host"]["host_loads"] > 0
        assert rows["radix+host"]["hit_rate"] > rows["radix"]["hit_rate"]
        assert rows["radix"]["tokens_digest"] == rows["radix+host"]["tokens_digest"]  # fp32: the same tokens
    pools = {row["working_set_ratio"]: row["pool_tokens"] for row in data["results"]}
    assert pools[2] > pools[4]
    assert [row["ratio"] for row in data["ratios"]] == ["radix+host/radix"] * 2
    assert data["copy_bandwidth"]["bytes"] > 0
    assert [verdict["workload"] for verdict in data["bars"]] == ["long-context-chat@4x"] * 2  # the bar is at ~4x
    pytest.importorskip("matplotlib")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "plot.py"
    spec = importlib.util.spec_from_file_location("kvplug_benchmarks_plot_tier", path)
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    plot.plot_host_tier([data], tmp_path / "host_tier.png")
    assert (tmp_path / "host_tier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
