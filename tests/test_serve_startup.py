"""``kvplug serve`` is ready when ``/health`` says so (issue 29 item 3): ``config.json`` is checked
before the weights load, the KV pool is built and the batching worker started before ``/health``
answers ok, and until then ``/health`` and ``/kvplug/stats`` answer 503 ``starting``."""

from __future__ import annotations

import json
import shutil
import time
from types import SimpleNamespace

import pytest
import torch

from kvplug.interface import InvalidArgumentError
from tests.serve_process import REPO_ROOT, free_port, get_json, post, start, stop

pytest.importorskip("fastapi")
transformers = pytest.importorskip("transformers")
from kvplug_transformers.model_checks import check_model_config  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvplug-cache")


@pytest.fixture(scope="module")
def embedded(cache_dir):
    from kvplug_transformers.embedded_model import ensure_embedded_model

    return ensure_embedded_model(cache_dir)


def _qwen3(**fields):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, architectures=["Qwen3ForCausalLM"])
    return transformers.Qwen3Config(**{**base, **fields})


def test_a_full_attention_causal_lm_passes():
    check_model_config(_qwen3(), "m", "kvplug", torch.bfloat16)


def _plain(**fields):
    """A config as a plain object: transformers' own config classes refuse some of these values themselves."""
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8)
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize(("config", "backend", "dtype", "message"), [
    (lambda: _qwen3(use_sliding_window=True, sliding_window=32, max_window_layers=0), "kvplug", torch.float32,
     "all full attention; m/config.json gives ['sliding_attention'] layers (sliding_window 32)"),
    (lambda: _qwen3(architectures=["Qwen3ForSequenceClassification"]), "kvplug", torch.float32,
     "architectures in m/config.json is ['Qwen3ForSequenceClassification']"),
    (lambda: _plain(num_key_value_heads=3), "native", torch.float32,
     "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (lambda: _plain(head_dim=None, hidden_size=30), "native", torch.float32, "hidden_size 30 is not a multiple"),
    (lambda: _plain(head_dim=0), "native", torch.float32, "head_dim in m/config.json must be a positive int, got 0"),
    (lambda: _qwen3(), "kvplug", torch.float64, "dtype torch.float64"),
])
def test_what_config_json_decides_is_checked_with_the_field_named(config, backend, dtype, message):
    with pytest.raises(InvalidArgumentError) as refused:
        check_model_config(config(), "m", backend, dtype)
    assert message in str(refused.value)
    check_model_config(_plain(), "m", "native", torch.float16)  # the same check passes a sound config


def test_native_backend_may_serve_sliding_window_layers():
    check_model_config(_qwen3(use_sliding_window=True, sliding_window=32, max_window_layers=0), "m", "native",
                       torch.float32)


def test_a_sliding_window_checkpoint_is_refused_before_it_listens(embedded, cache_dir, tmp_path):
    checkpoint = tmp_path / "sliding"
    shutil.copytree(embedded, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=32, max_window_layers=0)
    config.pop("layer_types", None)
    (checkpoint / "config.json").write_text(json.dumps(config))
    port, log = free_port(), tmp_path / "serve.log"
    process = start(["-m", "kvplug", "serve", str(checkpoint), "--port", str(port), "--kv-memory", "4MiB"],
                    cache_dir, log)
    try:
        code = process.wait(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert code == 2, text[-3000:]
    assert "['sliding_attention'] layers (sliding_window 32): serve it with --kv-backend native" in text
    assert "listening on" not in text and "Traceback" not in text


def test_health_says_starting_until_the_pool_is_built(embedded, cache_dir, tmp_path):
    gate, port, log = tmp_path / "gate", free_port(), tmp_path / "serve.log"
    process = start([str(REPO_ROOT / "tests" / "serve_with_gated_pool.py"), str(gate), "serve", "--port", str(port),
                     "--kv-memory", "4MiB", "--max-seq-len", "256"], cache_dir, log)
    try:
        deadline = time.monotonic() + 180
        while True:  # the HTTP server comes up while the pool build waits for the gate
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                status, health = get_json(port, "/health", timeout=5)
                break
            except OSError:
                time.sleep(0.2)
        assert (status, health["status"]) == (503, "starting"), health
        status, stats = get_json(port, "/kvplug/stats", timeout=5)
        assert (status, stats["status"]) == (503, "starting")
        assert "listening on" not in log.read_text()
        gate.touch()
        while get_json(port, "/health", timeout=5)[0] != 200:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        status, stats = get_json(port, "/kvplug/stats", timeout=5)
        assert (status, stats["status"]) == (200, "ok") and stats["num_pages"] > 0  # the pool exists already
        status, reply = post(port, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
        assert status == 200, reply
    finally:
        code, _ = stop(process)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert text.index("KV cache built, batching worker running") < text.index("listening on")


def test_health_says_starting_until_the_worker_warm_up_returns(embedded, cache_dir, tmp_path):
    """The decode CUDA graphs are captured on the batching thread before ``/health`` says ok (on
    the CPU the warm-up captures nothing, but it is the same step: gated here until a file exists)."""
    gate, record, port, log = tmp_path / "gate", tmp_path / "record", free_port(), tmp_path / "serve.log"
    process = start([str(REPO_ROOT / "tests" / "serve_with_gated_capture.py"), str(gate), str(record), "serve",
                     "--port", str(port), "--kv-memory", "4MiB", "--max-seq-len", "256"], cache_dir, log)
    try:
        deadline = time.monotonic() + 180
        while not record.exists():  # the pool is built and the warm-up waits for the gate
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        status, health = get_json(port, "/health", timeout=5)
        assert (status, health["status"]) == (503, "starting"), health
        assert "KV cache built, batching worker running" not in log.read_text()
        gate.touch()
        while get_json(port, "/health", timeout=5)[0] != 200:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        status, reply = post(port, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 4}).encode())
        assert status == 200, reply
    finally:
        code, _ = stop(process)
    assert code == 0, log.read_text()[-3000:]
    threads = record.read_text().splitlines()
    assert len(threads) == 1 and threads[0] != "MainThread", threads  # once, on the batching thread
