"""Issue 32 through real ``kvplug serve`` processes: a third-party prefix cache with a host tier that
faults in its tier methods mid-run never takes the server down.

The plugin is ``tests.faulty_tiered_cache``'s ``faulty-tiered``, installed as a ``kvplug`` entry
point (``tests.faulty_tiered_cache_entry``) and picked by ``--prefix-cache faulty-tiered
--host-memory SIZE``. Concurrent multi-turn chats share a pool of 47 pages, so earlier turns are
written back to host memory and the next turn loads them (host-tier hits); from its
``after``-th call of the faulting tier method on, the plugin raises or answers wrongly. Then:

- every request is answered 200 (the checked wrapper turns the fault into a quarantine before
  kvplug used the answer, so not even the request that met it fails);
- the server stays healthy: ``/kvplug/stats`` shows the worker alive, the quarantine
  (``cache_guard``: a failure naming the plugin and the tier method, ``naive`` serving) and, at
  idle, no leaked page (``used_pages == cached_pages``, nothing running, admitted == finished);
- greedy replies, turn after turn, equal those of a server with the built-in ``radix`` cache.

The default run serves three faults (a load that raises, a load and a host match that answer wrongly) on a fixed workload, each well
under a minute; ``--run-slow`` adds randomised workloads over every tier fault.
"""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.faulty_tiered_cache import all_tiered_faults
from tests.faulty_tiered_cache_entry import write_distribution
from tests.serve_process import REPO_ROOT, free_port, get_json, post, start, stop, wait_ready

SERVER_FLAGS = ("--kv-memory", "3MiB", "--max-seq-len", "512", "--page-size", "16", "--max-running-reqs", "4",
                "--log-level", "warning")
HOST_MEMORY = "8MiB"
#: tier methods whose faults a host asks for on the serving path (host_size_info is asked by none)
SERVED_TIER_FAULTS = [fault for fault in all_tiered_faults() if not fault.startswith("host_size_info")]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    for module in ("transformers", "fastapi", "uvicorn"):
        pytest.importorskip(module)
    from kvplug_transformers.embedded_model import ensure_embedded_model

    directory = tmp_path_factory.mktemp("kvplug-cache")
    ensure_embedded_model(directory)
    return directory


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    return write_distribution(tmp_path_factory.mktemp("faulty-tiered-site"))


class Workload(NamedTuple):
    """``chats`` conversations of ``turns`` turns each, ``concurrency`` chats at a time."""

    chats: int
    turns: int
    concurrency: int
    max_tokens: int
    seed: int


QUICK = Workload(chats=6, turns=4, concurrency=6, max_tokens=6, seed=0)


def _opening(workload: Workload, chat: int) -> list[dict]:
    rng = random.Random(workload.seed * 1000 + chat)
    topic = rng.choice(["paged attention", "radix trees", "pinned memory", "CUDA graphs", "prefix caches"])
    system = f"Chat {chat}. You explain {topic} to engineers, briefly and exactly."
    return [{"role": "system", "content": system}, {"role": "user", "content": f"What is {topic}?"}]


def _follow_up(workload: Workload, chat: int, turn: int) -> str:
    rng = random.Random(workload.seed * 1000 + chat * 10 + turn)
    return rng.choice(["Say more.", "Why is that?", "Give an example.", "And on a GPU?"]) + f" (turn {turn})"


def run_chats(port: int, workload: Workload) -> tuple[list[list[str]], list[tuple[int, str]]]:
    """Every chat of ``workload``, turn by turn (each turn sends the whole history so far), at most
    ``concurrency`` at once. Returns each chat's greedy replies and every non-200 (status, body)."""
    problems: list[tuple[int, str]] = []

    def chat(number: int) -> list[str]:
        messages, replies = _opening(workload, number), []
        for turn in range(workload.turns):
            body = {"model": "kvplug-default", "messages": messages, "max_tokens": workload.max_tokens,
                    "temperature": 0}
            status, answer = post(port, "/v1/chat/completions", json.dumps(body).encode(), timeout=120)
            if status != 200:
                problems.append((status, json.dumps(answer)[:300]))
                return replies
            text = answer["choices"][0]["message"]["content"]
            replies.append(text)
            messages = [*messages, {"role": "assistant", "content": text},
                        {"role": "user", "content": _follow_up(workload, number, turn)}]
        return replies

    with ThreadPoolExecutor(workload.concurrency) as pool:
        return list(pool.map(chat, range(workload.chats))), problems


def serve(cache_dir: Path, log: Path, prefix_cache: str, *flags: str, plugin_site: Path | None = None,
          fault: str = "none", after: int = 2):
    """A ``kvplug serve`` process with ``prefix_cache`` (the plugin's site on ``PYTHONPATH`` when
    given); (process, port) once it answers."""
    port = free_port()
    with pytest.MonkeyPatch.context() as patch:  # start() copies the environment
        if plugin_site is not None:
            patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(plugin_site), str(REPO_ROOT),
                                                                     os.environ.get("PYTHONPATH")])))
        patch.setenv("KVPLUG_TEST_FAULT", fault)
        patch.setenv("KVPLUG_TEST_FAULT_AFTER", str(after))
        process = start(["-m", "kvplug", "serve", "--port", str(port), "--prefix-cache", prefix_cache,
                         *SERVER_FLAGS, *flags], cache_dir, log)
    wait_ready(process, port, log)
    return process, port


def reference_replies(cache_dir: Path, log: Path, workload: Workload) -> list[list[str]]:
    """``workload``'s replies from a server with the built-in ``radix`` cache (no tier, no plugin)."""
    process, port = serve(cache_dir, log, "radix")
    try:
        replies, problems = run_chats(port, workload)
    finally:
        code, _ = stop(process)
    assert not problems and code == 0, (problems, log.read_text()[-3000:])
    return replies


@pytest.fixture(scope="module")
def quick_reference(cache_dir, tmp_path_factory) -> list[list[str]]:
    return reference_replies(cache_dir, tmp_path_factory.mktemp("radix") / "serve.log", QUICK)


def _idle_stats(port: int) -> dict:
    """``/kvplug/stats`` once nothing runs (the last reply may precede its request's finish by a step)."""
    deadline = time.monotonic() + 10
    while True:
        status, stats = get_json(port, "/kvplug/stats")
        assert status == 200, stats
        if (stats["running_requests"] == 0 and stats["in_flight"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def check_faulty_run(cache_dir: Path, plugin_site: Path, log: Path, workload: Workload, fault: str, after: int,
                     expected: list[list[str]]) -> None:
    """Serve ``workload`` with the plugin faulting as ``fault`` from its ``after``-th call on and
    check what the module docstring says."""
    process, port = serve(cache_dir, log, "faulty-tiered", "--host-memory", HOST_MEMORY, plugin_site=plugin_site,
                          fault=fault, after=after)
    try:
        status, stats = get_json(port, "/kvplug/stats")
        assert status == 200 and stats["cache_guard"]["prefix_cache"] == "faulty-tiered", stats
        assert stats["host_pages"] > 0, stats  # the plugin's tier is attached
        replies, problems = run_chats(port, workload)
        assert not problems, (problems, log.read_text()[-3000:])  # every request answered 200
        stats = _idle_stats(port)
        method = fault.partition(":")[0]
        guard = stats["cache_guard"]
        assert guard["cache_failures"] >= 1 and guard["prefix_cache"] == "naive" and not guard["stopped"], guard
        assert f"prefix cache 'faulty-tiered': {method}" in guard["last_cache_fault"], guard
        if method == "start_host_load" and after:  # ``after`` loads behaved: the tier served hits first
            assert stats["host_hit_tokens"] > 0, stats
        # (loads_in_flight and tier_stats are asked on every match / eviction: they may fault before any hit)
        assert stats["worker"]["alive"] and process.poll() is None, stats
        assert stats["running_requests"] == 0 and stats["in_flight"] == 0, stats
        assert stats["used_pages"] == stats["cached_pages"], stats  # no page leaked
        assert stats["admitted_requests"] == stats["finished_requests"], stats
        status, health = get_json(port, "/health")
        assert status == 200 and health["status"] == "degraded" and health["prefix_cache"] == guard, health
        assert replies == expected, "greedy replies differ from the radix server's"
        after_fault, problems = run_chats(port, workload._replace(chats=2, turns=1, concurrency=2))
        assert not problems and after_fault == [chat[:1] for chat in expected[:2]]  # still serving, same answers
    finally:
        code, _ = stop(process)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "prefix cache 'faulty-tiered' failed in" in text and "prefix cache 'naive' takes over" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("fault, after", [("start_host_load:raise", 2), ("start_host_load:lost_locations", 2),
                                          ("match_tiered:long_host_len", 4)])
def test_a_tiered_plugin_faulting_mid_run_is_quarantined_and_every_chat_answered(cache_dir, plugin_site, tmp_path,
                                                                                quick_reference, fault, after):
    check_faulty_run(cache_dir, plugin_site, tmp_path / "serve.log", QUICK, fault, after, quick_reference)


def test_serve_refuses_host_memory_for_a_cache_without_a_tier(cache_dir, plugin_site, tmp_path):
    """``--host-memory`` is accepted for a plugin whose cache has a tier (above); for one without
    (``faulty``, version 1: radix refuses the option) validation says why, before any model loads."""
    from kvplug.cli import build_parser
    from kvplug.cli.serve import validate
    from kvplug.interface import InvalidArgumentError
    from kvplug.plugins import PluginManager
    from tests.faulty_cache import FaultyCachePlugin
    from tests.faulty_tiered_cache import FaultyTieredCachePlugin

    manager = PluginManager(entry_points=False)
    manager.register(FaultyCachePlugin(), "faulty")
    manager.register(FaultyTieredCachePlugin(), "faulty-tiered")
    parse = lambda *argv: build_parser().parse_args(["serve", *argv])  # noqa: E731
    options = validate(parse("--prefix-cache", "faulty-tiered", "--host-memory", "1MiB"), manager)
    assert options["host_memory"] == 1 << 20 and options["prefix_cache"] == "faulty-tiered"
    with pytest.raises(InvalidArgumentError, match="--host-memory: prefix cache 'faulty' takes no host_memory option"):
        validate(parse("--prefix-cache", "faulty", "--host-memory", "1MiB"), manager)


@pytest.mark.slow
@pytest.mark.parametrize("fault", SERVED_TIER_FAULTS)
def test_randomised_tiered_faults_under_concurrent_chats(cache_dir, plugin_site, tmp_path, fault):
    """``--run-slow``: each tier fault, after a random number of calls, on a random workload."""
    seed = SERVED_TIER_FAULTS.index(fault)
    rng = random.Random(seed)
    workload = Workload(chats=rng.randint(8, 12), turns=rng.randint(4, 5), concurrency=rng.randint(5, 8),
                        max_tokens=rng.choice([4, 8, 16]), seed=seed + 1)
    expected = reference_replies(cache_dir, tmp_path / "radix.log", workload)
    check_faulty_run(cache_dir, plugin_site, tmp_path / "serve.log", workload, fault, rng.randint(1, 3), expected)
