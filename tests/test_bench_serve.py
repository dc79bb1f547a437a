"""``kvplug bench serve``: the client drives real ``kvplug serve`` processes (embedded model, loopback)
through the ``openai`` client, an A/B in one run, and reports every request with its percentiles."""

from __future__ import annotations

import json
import os

import pytest

from kvplug.bench.serve import RequestRecord, conversations, summarize
from kvplug.cli import main
from tests.serve_process import kvplug_env
from tests.test_serve import cache_dir, embedded, server_deps  # noqa: F401 (fixtures)


def test_summary_percentiles_and_throughputs_come_from_the_records():
    records = [RequestRecord(True, 0.1, 1.1, 11, (0.1,) * 10, ""), RequestRecord(True, 0.3, 1.3, 11, (0.1,) * 10, ""),
               RequestRecord(False, 0.0, 0.5, 0, (), "APIError: boom")]
    summary = summarize(records, elapsed=2.0)
    assert summary["requests"] == 3 and summary["failed"] == 1 and summary["errors"] == ["APIError: boom"]
    assert summary["output_throughput"] == pytest.approx(11.0) and summary["request_throughput"] == pytest.approx(1.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0) and summary["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert summary["itl_ms"]["p99"] == pytest.approx(100.0)


def test_multi_turn_chats_have_their_turns_and_the_datasets_differ():
    import argparse

    args = argparse.Namespace(dataset="multi-turn", conversations=3, turns=4, question_chars=20, num_prompts=5, seed=0)
    chats = conversations(args)
    assert len(chats) == 3 and all(len(chat) == 4 for chat in chats)
    args.dataset = "random"
    assert [len(chat) for chat in conversations(args)] == [1] * 5


def test_an_ab_run_against_two_real_servers(server_deps, cache_dir, tmp_path, monkeypatch):  # noqa: F811
    for key, value in kvplug_env(cache_dir).items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--quick", "--serve-args", "--max-seq-len 2048", "--serve-args",
                 "--max-seq-len 2048 --kv-backend native", "--system-chars", "200", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [side["name"] for side in result["sides"]] == ["--max-seq-len 2048", "--max-seq-len 2048 --kv-backend native"]
    for side in result["sides"]:
        assert side["requests"] == 8 and side["failed"] == 0, side["errors"]
        assert side["output_throughput"] > 0 and side["ttft_ms"]["p50"] > 0
    assert result["ratios"][0]["versus"] == result["sides"][1]["name"]
    assert os.environ["KVPLUG_CACHE_DIR"] == str(cache_dir)


def test_serve_args_may_set_the_side_environment_and_server_cpu_is_read_from_proc():
    import pytest as _pytest

    from kvplug.bench.process_cpu import CpuPerToken, process_cpu
    from kvplug.bench.serve import serve_environment
    from kvplug.interface import KVPlugError

    assert serve_environment("PYTHONPATH=/tmp/old A_1=x --engine-process --x Y=1") == (
        {"PYTHONPATH": "/tmp/old", "A_1": "x"}, ["--engine-process", "--x", "Y=1"])
    assert serve_environment("--max-seq-len 2048") == ({}, ["--max-seq-len", "2048"])
    before = process_cpu(os.getpid())
    sum(i * i for i in range(3_000_000))  # some CPU of our own
    spent = process_cpu(os.getpid()) - before
    assert spent.own_s > 0 and spent.descendants_s == 0
    per = CpuPerToken(0.5, 2.0, 1000)
    assert per.http_us_per_token == _pytest.approx(500.0) and per.to_json()["engine_cpu_us_per_token"] == 2000.0
    with _pytest.raises(KVPlugError, match="expected a live process"):
        process_cpu(2**22 + 12345)
