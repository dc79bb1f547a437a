"""Issue 32 through a real SGLang 0.5.23 server on the CPU: ``--kv-backend kvplug --prefix-cache
faulty``, the fault-injecting plugin of ``tests.faulty_cache`` installed as a kvplug entry point
(``tests.faulty_cache_entry``), whose matches answer a location outside the pool from its
eleventh non-empty match on: past the requests sent one at a time, so it meets the scheduler while
requests sent eight at a time run with locked prefixes (on the 2-core CI machine the warning
reports 72 such pages kept for them).

- default policy (``fallback``): the scheduler quarantines the plugin and keeps serving: requests
  sent one at a time and eight at a time all complete; after the fault the same prompts give the
  same greedy tokens as before it; ``/server_info`` reports the quarantine (``internal_states[0]
  ["kvplug_prefix_cache"]``) and so does ``/health`` (``{"status": "degraded", "prefix_cache": ...}``,
  still 200, as ``kvplug serve``'s); ``/flush_cache`` works; SIGTERM stops the server cleanly.
- ``--kvplug-on-cache-failure fail``: the server stops, its log naming the plugin, SGLang's call
  and what the plugin answered.

Runs in the SGLang test environment (``scripts/test-sglang-host.sh``); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.sglang_helpers import import_sglang

import_sglang()

from tests.sglang_models import build_model  # noqa: E402
from tests.sglang_server import Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAULT = "match_prefix:outside_pool"
FAMILIES = ["The kv cache keeps keys and values of every token; ", "Radix trees share prefixes between requests, "]
PROMPTS = [family + tail for family in FAMILIES for tail in ("pages hold them.", "a router reads events.", "so less is computed.")]
TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("sglang-models") / "llama")


@pytest.fixture(scope="module")
def faulty_plugin_installed(tmp_path_factory):
    """``faulty`` as an installed kvplug plugin for every process the server starts."""
    site = tmp_path_factory.mktemp("faulty-plugin-site")
    info = site / "kvplug_test_faulty_cache-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvplug-test-faulty-cache\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[kvplug]\nfaulty = tests.faulty_cache_entry\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), str(ROOT), os.environ.get("PYTHONPATH")])))
        patch.setenv("KVPLUG_TEST_FAULT", FAULT)
        patch.setenv("KVPLUG_TEST_FAULT_AFTER", "10")
        yield


def faulty_server(model: Path, log: Path, *flags: str) -> Server:
    return Server(model, log, "--kv-backend", "kvplug", "--prefix-cache", "faulty", "--kvplug-attention", "torch", *flags)


def quarantine_record(server: Server) -> dict:
    """``/server_info``'s kvplug prefix-cache record (one DP rank here)."""
    import requests

    states = requests.get(f"{server.url}/server_info", timeout=30).json()["internal_states"]
    assert len(states) == 1, states
    return states[0]["kvplug_prefix_cache"]


def health(server: Server) -> tuple[int, bytes]:
    import requests

    answer = requests.get(f"{server.url}/health", timeout=30)
    return answer.status_code, answer.content


def test_the_server_quarantines_the_plugin_and_keeps_serving(model, faulty_plugin_installed, tmp_path):
    server = faulty_server(model, tmp_path / "fallback.log").start()
    try:
        assert quarantine_record(server) == {
            "prefix_cache": "faulty", "cache_failures": 0, "last_cache_fault": None, "on_cache_failure": "fallback",
            "stopped": False, "quarantined_prefix_cache": None,
        }
        assert health(server) == (200, b"")  # SGLang's own answer while nothing faulted
        before = [server.generate(prompt, TOKENS)["output_ids"] for prompt in PROMPTS]
        with ThreadPoolExecutor(8) as pool:  # running requests hold locked prefixes while others match
            answers = list(pool.map(lambda prompt: server.generate(prompt, 2 * TOKENS), PROMPTS * 2))
        assert all(len(answer["output_ids"]) == 2 * TOKENS for answer in answers)
        log = server.log.read_text(errors="replace")
        assert "kvplug prefix cache 'faulty' failed in SGLang's match_prefix" in log, server.log_tail()
        assert "outside the pool" in log and "prefix cache 'naive' takes over" in log
        record = quarantine_record(server)  # /server_info reports it too, not only the log
        assert record["cache_failures"] >= 1 and record["prefix_cache"] == "naive" and not record["stopped"], record
        assert record["quarantined_prefix_cache"] == "faulty" and "outside the pool" in record["last_cache_fault"]
        status, body = health(server)  # /health reports it as kvplug serve's does, still 200: it serves
        assert status == 200 and json.loads(body) == {"status": "degraded", "prefix_cache": record}, body
        after = [server.generate(prompt, TOKENS)["output_ids"] for prompt in PROMPTS]
        assert after == before, "the tokens changed after the quarantine"
        assert server.post("/flush_cache").status_code == 200
        assert server.generate(PROMPTS[0], TOKENS)["output_ids"] == before[0]
    except BaseException:
        server.kill()
        raise
    assert server.stop() == 0
    assert "Traceback" not in server.log.read_text(errors="replace"), server.log_tail()


def test_policy_fail_stops_the_server_naming_the_plugin(model, faulty_plugin_installed, tmp_path):
    import requests

    server = faulty_server(model, tmp_path / "fail.log", "--kvplug-on-cache-failure", "fail").start()
    try:
        for prompt in PROMPTS * 3:
            try:
                requests.post(f"{server.url}/generate", timeout=60,
                              json={"text": prompt, "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0}})
            except requests.RequestException:
                break
            if server.process.poll() is not None:
                break
        deadline = time.monotonic() + 60
        while server.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert server.process.poll() is not None, f"the server kept running:\n{server.log_tail()}"
        log = server.log.read_text(errors="replace")
        assert "kvplug prefix cache 'faulty' failed in SGLang's match_prefix and the scheduler stops" in log, (
            server.log_tail()
        )
        assert "(--kvplug-on-cache-failure fail)" in log and "outside the pool" in log
    finally:
        server.kill()
