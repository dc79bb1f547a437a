"""``kvplug bench serve``: the client drives real ``kvplug serve`` processes (embedded model, loopback)
through the ``openai`` client, an A/B in one run, and reports every request with its percentiles and
its own CPU, from one client process or several (``--client-processes``)."""

from __future__ import annotations

import json
import os

import pytest

from kvplug.bench.process_cpu import ClientCpu
from kvplug.bench.serve import RequestRecord, conversations, summarize
from kvplug.bench.serve_clients import split_clients
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


def test_client_processes_split_the_chats_the_cap_and_the_rate_evenly():
    chats = [[f"chat {i}"] for i in range(10)]
    shares = split_clients(chats, max_concurrency=7, request_rate=20.0, processes=3)
    assert [share.max_concurrency for share in shares] == [3, 2, 2]
    assert sorted(chat for share in shares for chat in share.chats) == sorted(chats)  # each chat once
    assert [len(share.chats) for share in shares] == [4, 3, 3]
    assert [share.request_rate for share in shares] == pytest.approx([8.0, 6.0, 6.0])
    assert all(share.request_rate == float("inf") for share in split_clients(chats, 4, float("inf"), 2))
    assert len(split_clients(chats, 1, 1.0, 1)[0].chats) == 10
    for processes in (0, 2):
        with pytest.raises(ValueError, match="--client-processes"):
            split_clients(chats, max_concurrency=1, request_rate=1.0, processes=processes)


def test_a_client_process_that_dies_ends_the_run_with_its_name():
    import argparse

    pytest.importorskip("openai")
    from kvplug.bench.serve_clients import ClientProcesses
    from tests.serve_process import free_port

    args = argparse.Namespace(dataset="random", num_prompts=2, question_chars=10, system_chars=10, seed=0,
                              max_concurrency=2, request_rate=float("inf"), startup_timeout=60.0, api_key="none",
                              model=None, no_stream=False, output_tokens=4)
    nothing_listens = f"http://127.0.0.1:{free_port()}/v1"  # resolving the model fails: the process exits
    with pytest.raises(RuntimeError, match=r"client process kvplug-bench-client-\d \(\d of 2, pid \d+\) exited"):
        with ClientProcesses(nothing_listens, args, conversations(args), 2):
            pass


def test_client_cpu_is_per_output_token_and_per_wall_second():
    cpu = ClientCpu((1.0, 0.5), 0.1, wall_s=2.0, output_tokens=16_000).to_json()
    assert cpu["client_processes"] == 2 and cpu["client_cpu_s"] == pytest.approx(1.6)
    assert cpu["client_cpu_us_per_token"] == pytest.approx(100.0) and cpu["client_cores"] == pytest.approx(0.8)
    assert cpu["process_cores"] == pytest.approx([0.5, 0.25])


def test_one_server_measured_with_one_and_two_client_processes(server_deps, cache_dir, tmp_path, monkeypatch):  # noqa: F811
    for key, value in kvplug_env(cache_dir).items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--quick", "--serve-args", "--max-seq-len 2048", "--client-processes", "1", "2",
                 "--dataset", "random", "--max-concurrency", "3", "--warmup", "1",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [side["name"] for side in result["sides"]] == ["1 client procs, --max-seq-len 2048",
                                                          "2 client procs, --max-seq-len 2048"]
    for side, processes in zip(result["sides"], (1, 2)):
        assert side["requests"] == 4 and side["failed"] == 0, side["errors"]  # --quick: 4 prompts, each once
        cpu = side["client_cpu"]
        assert cpu["client_processes"] == processes and all(seconds > 0 for seconds in cpu["process_cpu_s"])
        assert cpu["client_cpu_us_per_token"] > 0 and 0 < cpu["client_cores"]
        assert cpu["output_tokens"] == round(side["output_throughput"] * side["seconds"])
        assert side["server_cpu"]["output_tokens"] == cpu["output_tokens"]
