"""Issue 32 through a real SGLang 0.5.23 server on the CPU: ``--kv-backend kvplug --prefix-cache
faulty-tiered --kvplug-host-memory 16MiB``, the fault-injecting tiered plugin of
``tests.faulty_tiered_cache`` installed as a kvplug entry point (``tests.faulty_tiered_cache_entry``).
A KV pool of 256 tokens and ten distinct 100-token prompts push the earlier prompts to host memory;
when they come back SGLang loads them (``init_load_back``). The plugin's first load behaves, its
later ones return a handle whose locations are not the ones it was given (``start_host_load:
lost_locations``, a wrong answer that would have the request read another request's K/V).

- the scheduler quarantines the plugin at that load (its log names the plugin, SGLang's call and
  what the plugin answered) and keeps serving: the request that met the fault recomputes its tail,
  later ones, one at a time and four at a time, all complete;
- the greedy tokens of every request equal those of a server with the built-in ``radix`` cache
  and the same host tier; SIGTERM stops both cleanly.

Runs in the SGLang test environment (``scripts/test-sglang-host.sh``); skipped elsewhere. About two
minutes on the 2-core machine, most of it two server starts.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.sglang_helpers import import_sglang

import_sglang()

from tests.faulty_tiered_cache_entry import write_distribution  # noqa: E402
from tests.sglang_models import build_model  # noqa: E402
from tests.sglang_server import Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAULT = "start_host_load:lost_locations"
PROMPTS = [f"{number}: " + chr(ord("a") + number) * 97 for number in range(10)]  # 100 tokens each
RETURNING = [0, 1, 2, 3]
MAX_NEW_TOKENS = 4
FLAGS = ("--kv-backend", "kvplug", "--kvplug-attention", "torch", "--max-total-tokens", "256",
         "--max-running-requests", "2", "--kvplug-host-memory", "16MiB")  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("sglang-models") / "llama")


@pytest.fixture(scope="module")
def plugin_installed(tmp_path_factory):
    """``faulty-tiered`` as an installed kvplug plugin for every process the server starts."""
    site = write_distribution(tmp_path_factory.mktemp("faulty-tiered-site"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), str(ROOT), os.environ.get("PYTHONPATH")])))
        patch.setenv("KVPLUG_TEST_FAULT", FAULT)
        patch.setenv("KVPLUG_TEST_FAULT_AFTER", "1")
        yield


def workload(server: Server) -> list[list[int]]:
    """Every prompt once, the returning ones one at a time, then all of them four at a time."""
    answers = [server.generate(prompt, MAX_NEW_TOKENS)["output_ids"] for prompt in PROMPTS]
    answers += [server.generate(PROMPTS[number], MAX_NEW_TOKENS)["output_ids"] for number in RETURNING]
    with ThreadPoolExecutor(4) as pool:
        answers += list(pool.map(lambda prompt: server.generate(prompt, MAX_NEW_TOKENS)["output_ids"], PROMPTS))
    return answers


@pytest.fixture(scope="module")
def runs(model, plugin_installed, tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-tiered-faults")
    results = {}
    for name, prefix_cache in (("radix", "radix"), ("faulty", "faulty-tiered")):
        server = Server(model, root / f"{name}.log", *FLAGS, "--prefix-cache", prefix_cache).start()
        try:
            answers = workload(server)
        except BaseException:
            server.kill()
            raise
        results[name] = (server, answers, server.stop())
    return results


def test_the_faulty_tiered_plugin_is_quarantined_and_every_request_served(runs):
    server, answers, status = runs["faulty"]
    log = server.log.read_text(errors="replace")
    assert "kvplug-sglang: host-memory tier of 16,777,216 bytes" in log, server.log_tail()  # the plugin's tier
    assert "kvplug prefix cache 'faulty-tiered' failed in SGLang's init_load_back" in log, server.log_tail()
    assert "load_host_prefix returned a handle that does not keep" in log and "prefix cache 'naive' takes over" in log
    assert len(answers) == len(PROMPTS) * 2 + len(RETURNING) and all(len(ids) == MAX_NEW_TOKENS for ids in answers)
    assert status == 0 and "Traceback" not in log, server.log_tail()


def test_greedy_tokens_equal_the_builtin_radix_cache(runs):
    expected, got = runs["radix"][1], runs["faulty"][1]
    for number, (mine, theirs) in enumerate(zip(got, expected)):
        assert mine == theirs, f"request {number}: with the faulty plugin {mine} != with radix {theirs}"
    radix_log = runs["radix"][0].log.read_text(errors="replace")
    assert runs["radix"][2] == 0 and "#cached-token: 99" in radix_log  # the reference did serve host hits
