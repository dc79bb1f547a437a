"""``kvplug serve`` on CUDA captures its decode CUDA graphs before ``/health`` says ok (issue 29):
the capture's log line comes before "KV cache built" and "listening on", in-process and with
``--engine-process``, and greedy requests are then served (the first one pays no capture: its
line is logged once, before ready). Real server processes on 127.0.0.1, the embedded model."""

from __future__ import annotations

import json

import pytest

from tests.attention_reference import requires_cuda
from tests.serve_process import free_port, get_json, post, start, stop, wait_ready

pytestmark = [pytest.mark.gpu, requires_cuda]
CAPTURED = "kvplug captured"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    for module in ("transformers", "fastapi", "uvicorn"):
        pytest.importorskip(module)
    from kvplug_transformers.embedded_model import ensure_embedded_model

    directory = tmp_path_factory.mktemp("kvplug-cache")
    ensure_embedded_model(directory)
    return directory


@pytest.mark.parametrize("extra", [(), ("--engine-process",)], ids=["in-process", "engine-process"])
def test_decode_graphs_are_captured_before_ready(cache_dir, tmp_path, extra):
    port, log = free_port(), tmp_path / "serve.log"
    process = start(["-m", "kvplug", "serve", "--device", "cuda", "--port", str(port), "--kv-memory", "64MiB",
                     "--max-seq-len", "512", "--cuda-graph-max-bs", "8", *extra], cache_dir, log)
    try:
        wait_ready(process, port, log)
        status, health = get_json(port, "/health")
        assert (status, health["status"]) == (200, "ok"), health
        text = log.read_text()
        assert CAPTURED in text, text[-4000:]
        assert text.index(CAPTURED) < text.index("KV cache built, batching worker running"), text[-4000:]
        for _ in range(3):
            status, reply = post(port, "/v1/completions",
                                 json.dumps({"prompt": "paged attention", "max_tokens": 16, "temperature": 0}).encode())
            assert status == 200 and reply["usage"]["completion_tokens"] > 0, reply
    finally:
        code, _ = stop(process)
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert text.count(CAPTURED) == 1, text[-4000:]  # before ready only: no request captured again
