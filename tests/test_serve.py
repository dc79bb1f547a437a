"""``kvplug serve``: argument checks, the embedded default model, and the server end to end.

The end-to-end test starts ``python -m kvplug serve`` on the embedded model in a subprocess on a
free port of 127.0.0.1, talks to it with the ``openai`` client (a chat completion, a streamed
one, a repeated prompt that must hit the prefix cache), then stops it with SIGTERM (exit code 0).
Bad arguments must end with a one-line error and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvplug.cli.serve import HOST_NAME, find_host, parse_kv_memory, register, validate
from kvplug.interface import InvalidArgumentError, KVPlugError, UnknownComponentError
from kvplug.plugins import PluginManager

REPO_ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 180


# ---------------------------------------------------------------------------- argument checks (no transformers)
def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_kv_memory_is_bytes_or_a_fraction():
    assert parse_kv_memory(None) is None
    assert parse_kv_memory("512MiB") == 512 * 2**20 and parse_kv_memory("1000") == 1000
    assert parse_kv_memory("0.25") == 0.25 and parse_kv_memory("50%") == 0.5 and parse_kv_memory("1.0") == 1.0
    for bad in ("1.5", "0%", "lots", "-3"):
        with pytest.raises(InvalidArgumentError):
            parse_kv_memory(bad)


def test_validate_checks_paths_and_names_before_loading_anything(tmp_path):
    manager = PluginManager(entry_points=False)
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        validate(_parse("--model", str(tmp_path / "missing")), manager)
    with pytest.raises(InvalidArgumentError, match="no config.json"):
        validate(_parse("--model", str(tmp_path)), manager)
    with pytest.raises(UnknownComponentError, match="'radix' \\(from kvplug.builtin.prefix_caches\\)"):
        validate(_parse("--prefix-cache", "radx"), manager)
    with pytest.raises(UnknownComponentError, match="--attention"):
        validate(_parse("--attention", "torch,nope"), manager)
    with pytest.raises(InvalidArgumentError, match="--page-size must be an int >= 1, got 0"):
        validate(_parse("--page-size", "0"), manager)
    # flags that only configure kvplug's cache are accepted with the native backend, named as ignored
    assert validate(_parse("--kv-backend", "native", "--prefix-cache", "naive"), manager)["ignored_flags"] == (
        "--prefix-cache configures kvplug's cache: ignored with --kv-backend native (transformers' own cache)",)
    options = validate(_parse("--kv-backend", "native", "--kv-memory", "0.5"), manager)
    assert options["kv_backend"] == "native" and options["kv_memory"] == 0.5 and options["host"] == "127.0.0.1"


def test_missing_host_plugin_names_the_install_command():
    with pytest.raises(KVPlugError, match="pip install -e ./adapters/transformers"):
        find_host(PluginManager(entry_points=False))


# ---------------------------------------------------------------------------- the embedded default model
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvplug-cache")


@pytest.fixture(scope="module")
def embedded(cache_dir) -> Path:
    pytest.importorskip("transformers")
    embedded_model = pytest.importorskip("kvplug_transformers.embedded_model")
    return embedded_model.ensure_embedded_model(cache_dir)


def test_embedded_model_is_built_once_and_loads_offline(embedded, cache_dir):
    import transformers
    from kvplug_transformers import embedded_model

    assert embedded.name == f"embedded-default-{embedded_model.spec_hash()}" and embedded_model.is_complete(embedded)
    weights = embedded / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert embedded_model.ensure_embedded_model(cache_dir) == embedded and weights.stat().st_mtime_ns == before
    tokenizer = transformers.AutoTokenizer.from_pretrained(embedded)
    text = "héllo wörld, 1 + 1 = 2"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    config = transformers.AutoConfig.from_pretrained(embedded)
    assert config.model_type == "qwen3" and config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


# ---------------------------------------------------------------------------- the server, in a subprocess
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_kvplug(args: list[str], cache_dir: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, KVPLUG_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    with open(log, "wb") as sink:
        return subprocess.Popen([sys.executable, "-m", "kvplug", *args], stdout=sink, stderr=subprocess.STDOUT, env=env)


def _stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/kvplug/stats", timeout=10) as response:
        return json.load(response)


def _wait_ready(process: subprocess.Popen, port: int, log: Path) -> dict:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"kvplug serve exited with {process.returncode} before serving:\n{log.read_text()[-4000:]}")
        try:
            return _stats(port)
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.25)
    process.kill()
    pytest.fail(f"kvplug serve did not answer within {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture()
def server_deps(embedded):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    return pytest.importorskip("openai")


def test_serve_embedded_model_end_to_end(server_deps, cache_dir, tmp_path):
    openai = server_deps
    port, log = _free_port(), tmp_path / "serve.log"
    args = ["serve", "--port", str(port), "--kv-memory", "32MiB", "--max-seq-len", "512", "--page-size", "16"]
    process = _run_kvplug([*args, "--max-running-reqs", "8", "--stats-interval", "1"], cache_dir, log)
    try:
        stats = _wait_ready(process, port, log)
        assert stats["kv_backend"] == "kvplug" and stats["cache_hit_tokens"] == 0
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        messages = [{"role": "user", "content": "Tell me about paged attention and prefix caching, please."}]

        reply = client.chat.completions.create(model=stats["model"], messages=messages, max_tokens=8)
        assert isinstance(reply.choices[0].message.content, str)
        assert 0 < reply.usage.completion_tokens <= 8 and reply.usage.prompt_tokens > 16

        stream = client.chat.completions.create(
            model=stats["model"], messages=[{"role": "user", "content": "stream"}], max_tokens=6, stream=True
        )
        chunks = [chunk for chunk in stream if chunk.choices]
        assert any(chunk.choices[0].delta.content for chunk in chunks)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")

        hits_before = _stats(port)["cache_hit_tokens"]
        again = client.chat.completions.create(model=stats["model"], messages=messages, max_tokens=8)
        after = _stats(port)
        assert again.choices[0].message.content == reply.choices[0].message.content  # greedy, same prompt
        assert after["cache_hit_tokens"] - hits_before >= 16 and after["finished_requests"] == 3
        assert after["prefix_cache"] == "radix" and after["attention"] == "torch"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert "kvplug KV pool" in output and "pages x 16 tokens" in output and "bytes" in output
    assert "prompt tokens hit" in output and "kvplug serve: stopped" in output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/kvplug-model"], "does not exist"),
        (["--prefix-cache", "no-such-cache"], "unknown prefix_cache 'no-such-cache'"),
        (["--kv-memory", "64KiB"], "too small for one request"),
    ],
)
def test_bad_arguments_fail_with_a_clear_error(embedded, cache_dir, tmp_path, args, message):
    log = tmp_path / "serve.log"
    process = _run_kvplug(["serve", "--port", str(_free_port()), *args], cache_dir, log)
    code = process.wait(timeout=STARTUP_TIMEOUT_S)
    output = log.read_text()
    assert code != 0, output[-4000:]
    assert "kvplug serve: error:" in output and message in output, output[-4000:]
    assert "Traceback" not in output


def test_host_is_found_through_the_plugin_manager():
    pytest.importorskip("kvplug_transformers")
    from kvplug_transformers import plugin

    manager = PluginManager(entry_points=False)
    manager.register(plugin, "transformers-test")
    host = find_host(manager)
    assert host.name == HOST_NAME and callable(host.serve)
