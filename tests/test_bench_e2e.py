"""``kvplug bench e2e``: workloads, metric arithmetic, ratios, and a smoke run on tiny sizes.

Timings are never asserted (benchmarks are not timed tests); the work done, the cache behaviour
and the JSON shape are. In fp32 on CPU every variant must generate the same tokens.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvplug import hookimpl
from kvplug.bench import discover_suites
from kvplug.bench.e2e import bars, ratios, resolve_sizes, run_config
from kvplug.bench.e2e_host import find_e2e_host
from kvplug.bench.e2e_runner import Variant, parse_variant, round_record, summarize
from kvplug.interface.errors import InvalidArgumentError, PluginLoadError
from kvplug.plugins.manager import PluginManager
from kvplug.bench.e2e_workloads import PRESETS, build_workload

SIZES = PRESETS["quick"]


def test_shared_prefix_requests_share_exactly_their_system_prompt():
    workload = build_workload("shared-prefix", SIZES, vocab=100, seed=3)
    prompts = workload.first_round
    assert workload.rounds == 1 and len(prompts) == SIZES.requests
    assert all(len(prompt) == SIZES.system_tokens + SIZES.question_tokens for prompt in prompts)
    heads = [tuple(prompt[: SIZES.system_tokens]) for prompt in prompts]
    assert len(set(heads)) == SIZES.system_prompts
    assert all(heads[i] == heads[i % SIZES.system_prompts] for i in range(len(prompts)))
    assert all(0 < token < 100 for prompt in prompts for token in prompt)  # 0 is the pad id
    assert build_workload("shared-prefix", SIZES, vocab=100, seed=3).first_round == prompts


def test_no_prefix_has_the_same_lengths_and_no_common_first_page():
    shared = build_workload("shared-prefix", SIZES, vocab=32_000, seed=0).first_round
    unique = build_workload("no-prefix", SIZES, vocab=32_000, seed=0).first_round
    assert sorted(map(len, unique)) == sorted(map(len, shared))
    assert len({tuple(prompt[:4]) for prompt in unique}) == len(unique)


def test_multi_turn_prompt_is_previous_prompt_answer_and_question():
    sizes = SIZES.updated(turns=3)
    workload = build_workload("multi-turn", sizes, vocab=1000, seed=1)
    first = workload.first_round
    answers = [[7] * sizes.output_tokens for _ in first]
    second = workload.next_round(1, first, answers)
    third = workload.next_round(2, second, answers)
    for prompt, follow_up, last in zip(first, second, third):
        assert follow_up[: len(prompt)] == prompt and follow_up[len(prompt): len(prompt) + sizes.output_tokens] == [7] * 4
        assert len(follow_up) == len(prompt) + sizes.output_tokens + sizes.question_tokens
        assert last[: len(follow_up)] == follow_up
    assert len(third[0]) + sizes.output_tokens == sizes.chat_prompt_tokens + sizes.output_tokens
    assert workload.next_round(1, first, answers) == second  # stateless: every variant gets the same turns
    with pytest.raises(ValueError):
        workload.next_round(3, third, answers)
    with pytest.raises(ValueError):
        workload.next_round(1, first, answers[:-1])


def _output(request_id, created, token_times, finished, tokens=(5, 6)):
    return SimpleNamespace(request_id=request_id, error=None, created_time=created, timestamps=list(token_times),
                           lifespan=(created, finished), generated_tokens=list(tokens))


def test_summarize_measures_from_submission_to_finish():
    rng = np.random.default_rng(0)
    created = rng.uniform(0.0, 0.01, 40)
    first = created + rng.uniform(0.1, 0.5, 40)
    finished = first + rng.uniform(0.2, 1.0, 40)
    outputs = [_output(f"r{i}", created[i], [first[i], finished[i]], finished[i]) for i in range(40)]
    prompts = [[1] * (10 + i) for i in range(40)]
    record = round_record(prompts, outputs)
    figures = summarize([record, record], wall_s=9.0)
    serve = finished.max() - created.min()
    assert figures["requests"] == 80 and figures["output_tokens"] == 160
    assert figures["prompt_tokens"] == 2 * sum(map(len, prompts))
    assert figures["serve_s"] == pytest.approx(2 * serve, abs=1e-4)
    assert figures["output_tok_per_s"] == pytest.approx(160 / (2 * serve), rel=1e-3)
    assert figures["ttft_p50_ms"] == pytest.approx(np.median(first - created) * 1e3, abs=0.01)
    assert figures["latency_p99_ms"] == pytest.approx(np.percentile(np.tile(finished - created, 2), 99) * 1e3, abs=0.01)
    other = round_record(prompts, [_output(o.request_id, o.created_time, o.timestamps, o.lifespan[1], (5, 7))
                                   for o in outputs])
    assert summarize([other], 1.0)["tokens_digest"] != summarize([record], 1.0)["tokens_digest"]


def test_round_record_rejects_failed_or_missing_requests():
    good = _output("a", 0.0, [0.1, 0.2], 0.2)
    with pytest.raises(RuntimeError, match="2 prompts"):
        round_record([[1], [2]], [good])
    failed = SimpleNamespace(**{**vars(good), "error": "boom", "request_id": "b"})
    with pytest.raises(RuntimeError, match="request b failed"):
        round_record([[1], [2]], [good, failed])


def test_ratios_and_bars_compare_radix_with_each_baseline():
    def row(workload, variant, throughput, ttft):
        return {"workload": workload, "concurrency": 8, "variant": variant, "output_tok_per_s": throughput,
                "ttft_p50_ms": ttft, "latency_p50_ms": ttft * 2}

    rows = [row("shared-prefix", "radix", 300.0, 10.0), row("shared-prefix", "naive", 100.0, 40.0),
            row("shared-prefix", "native", 200.0, 20.0), row("no-prefix", "radix", 97.0, 10.0),
            row("no-prefix", "naive", 100.0, 10.0)]
    table = {(r["workload"], r["ratio"]): r for r in ratios(rows)}
    assert set(table) == {("shared-prefix", "radix/naive"), ("shared-prefix", "radix/native"), ("no-prefix", "radix/naive")}
    assert table[("shared-prefix", "radix/naive")]["throughput"] == 3.0
    assert table[("shared-prefix", "radix/naive")]["ttft_p50"] == 0.25
    assert table[("shared-prefix", "radix/native")]["throughput"] == 1.5
    verdicts = {v["workload"]: v for v in bars(ratios(rows), at_issue_sizes=False)}
    assert verdicts["shared-prefix"]["met"] and not verdicts["no-prefix"]["met"]  # 0.97 < 0.98
    assert verdicts["no-prefix"]["measured"] == 0.97


def test_pool_holds_every_running_request_at_full_length():
    args = SimpleNamespace(quick=False, concurrency="3,1", **{name: None for name in (
        "requests", "system_prompts", "system_tokens", "question_tokens", "output_tokens", "conversations", "turns",
        "max_batch_tokens")})
    preset, sizes = resolve_sizes(args, torch.device("cpu"))
    assert preset == "cpu" and sizes.concurrency == (1, 3)
    workload = build_workload("multi-turn", sizes, vocab=100, seed=0)
    config = run_config(sizes, workload, 3, page_size=16, attention="torch")
    assert config.max_seq_len >= sizes.longest_request and config.max_seq_len % 16 == 0
    assert config.num_pages * 16 >= 3 * sizes.longest_request + sizes.system_prompts * sizes.system_tokens
    assert run_config(sizes, workload, 1000, 16, "torch").concurrency == sizes.conversations


def test_variant_names_parse_into_cache_option_and_tier():
    assert parse_variant("radix") == Variant("radix", "", False)
    assert parse_variant("radix+host:sync") == Variant("radix", "sync", True)
    assert parse_variant("naive:eager") == Variant("naive", "eager", False)
    assert parse_variant("native").native
    for bad in ("radix:fast", "native:sync", "native+host", "+host", ":eager"):
        with pytest.raises(InvalidArgumentError):
            parse_variant(bad)


def test_a_missing_host_adapter_is_named_with_how_to_install_it():
    manager = PluginManager(entry_points=False)  # the built-ins only: no host registered
    with pytest.raises(PluginLoadError) as caught:
        find_e2e_host("transformers", manager)
    message = str(caught.value)
    assert "'transformers' host adapter" in message and "pip install ./adapters/transformers" in message
    assert "it is not installed (hosts available: none)" in message


def test_a_host_without_an_e2e_runner_is_refused():
    class Plugin:
        @hookimpl
        def kvplug_register_hosts(self, register):
            register("plain", lambda **options: object())
            register("odd", lambda **options: type("Odd", (), {"e2e_bench": lambda self: "not a runner"})())

    manager = PluginManager(entry_points=False)
    manager.register(Plugin(), "hosts-for-test")
    with pytest.raises(PluginLoadError, match="has no e2e_bench"):
        find_e2e_host("plain", manager)
    with pytest.raises(PluginLoadError, match="expected a kvplug.bench.e2e_host.E2EHost"):
        find_e2e_host("odd", manager)


def test_cli_names_the_missing_adapter(monkeypatch, capsys):
    from kvplug.cli import main

    monkeypatch.setenv("KVPLUG_DISABLE_PLUGINS", "transformers")
    assert main(["bench", "e2e", "--quick"]) == 2
    error = capsys.readouterr().err
    # "installed ... but not loaded: KVPLUG_DISABLE_PLUGINS lists it" where the adapter is installed
    assert re.search(r"kvplug bench: error: kvplug bench e2e needs the 'transformers' host adapter: it is "
                     r"(installed \(kvplug-transformers .*KVPLUG_DISABLE_PLUGINS lists it|not installed)", error)
    assert "pip install ./adapters/transformers" in error


def test_e2e_suite_is_discovered():
    suites, _ = discover_suites()
    assert suites["e2e"].SUITE == "e2e" and not getattr(suites["e2e"], "REQUIRES_CUDA", False)


def test_quick_run_writes_json_and_variants_agree_token_for_token(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("kvplug_transformers")
    from kvplug.cli import main

    out = tmp_path / "e2e.json"
    previous_threads = torch.get_num_threads()
    try:
        code = main(["bench", "e2e", "--quick", "--threads", "1", "--concurrency", "4", "--requests", "6",
                     "--conversations", "3", "--out", str(out)])
    finally:
        torch.set_num_threads(previous_threads)
    assert code == 0
    data = json.loads(out.read_text())
    assert data["suite"] == "e2e" and data["quick"] and data["model"]["shape"] == "qwen3-tiny"
    assert data["model"]["dtype"] == "float32" and data["repeats"] == 1
    assert data["host"] == "transformers" and data["environment"]["transformers"] == transformers.__version__
    sizes = data["sizes"]
    rows = {(row["workload"], row["variant"]): row for row in data["results"]}
    assert set(rows) == {(w, v) for w in ("shared-prefix", "no-prefix", "multi-turn") for v in ("radix", "naive", "native")}
    for (workload, _variant), row in rows.items():
        requests = sizes["conversations"] * sizes["turns"] if workload == "multi-turn" else sizes["requests"]
        assert row["requests"] == requests and row["output_tokens"] == requests * sizes["output_tokens"]
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["ttft_p50_ms"] <= row["latency_p50_ms"]
        assert row["serve_s"] <= row["wall_s"]
    # radix hits the shared system prompts and earlier turns, naive never, native is not measured
    shared_hits = (sizes["requests"] - sizes["system_prompts"]) * sizes["system_tokens"]
    assert rows[("shared-prefix", "radix")]["cache_hit_tokens"] >= shared_hits * 0.5
    assert rows[("multi-turn", "radix")]["hit_rate"] > 0
    assert rows[("no-prefix", "radix")]["hit_rate"] == 0
    assert all(rows[(w, "naive")]["hit_rate"] == 0 and rows[(w, "native")]["hit_rate"] is None for w in
               ("shared-prefix", "no-prefix", "multi-turn"))
    for workload in ("shared-prefix", "no-prefix", "multi-turn"):
        assert len({rows[(workload, v)]["tokens_digest"] for v in ("radix", "naive", "native")}) == 1, workload
    assert {(r["workload"], r["ratio"]) for r in data["ratios"]} == {
        (w, f"radix/{b}") for w in ("shared-prefix", "no-prefix", "multi-turn") for b in ("naive", "native")}
    assert all(not verdict["at_issue_sizes"] for verdict in data["bars"])
    assert "radix/naive" in capsys.readouterr().out


def test_plot_script_draws_e2e_and_h200_figures(tmp_path):
    pytest.importorskip("matplotlib")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "plot.py"
    spec = importlib.util.spec_from_file_location("kvplug_benchmarks_plot", path)
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    rows = [{"workload": "shared-prefix", "concurrency": level, "variant": variant,
             "output_tok_per_s": 10.0 * level, "ttft_p50_ms": 100.0 / level}
            for level in (2, 8) for variant in ("radix", "naive")]
    data = {"results": rows, "variants": ["radix", "naive"], "repeats": 1, "sizes": SIZES.updated(concurrency=(2, 8)).to_json(),
            "model": {"shape": "qwen3-tiny", "dtype": "float32", "device": "cpu", "page_size": 16},
            "environment": {"torch_threads": 1}}
    plot.plot_e2e(data, tmp_path / "e2e.png")
    plot.plot_h200_bandwidth(json.loads((plot.RESULTS / "h200_attention.json").read_text()), tmp_path / "bandwidth.png")
    plot.plot_h200_graph_step(json.loads((plot.RESULTS / "h200_graphs.json").read_text()), tmp_path / "graphs.png")
    for name in ("e2e.png", "bandwidth.png", "graphs.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
