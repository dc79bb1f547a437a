"""Per-request sampling on ``kvplug serve --kv-backend native`` on CUDA (issue 29): a request with its
own sampling fields is either served by kvplug's sampler on transformers' logits (a seed repeats its
tokens; greedy repeats too) or refused with a 400 in OpenAI's error shape naming why (transformers'
own CUDA graphs replay one captured sampling) - never a 500, never ignored. Real server processes on
127.0.0.1, the embedded model, in-process and with ``--engine-process``."""

from __future__ import annotations

import json

import pytest

from tests.attention_reference import requires_cuda
from tests.serve_process import free_port, post, start, stop, wait_ready

pytestmark = [pytest.mark.gpu, requires_cuda]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    for module in ("transformers", "fastapi", "uvicorn"):
        pytest.importorskip(module)
    from kvplug_transformers.embedded_model import ensure_embedded_model

    directory = tmp_path_factory.mktemp("kvplug-cache")
    ensure_embedded_model(directory)
    return directory


def _complete(port: int, **fields) -> tuple[int, dict]:
    body = {"prompt": "paged attention on the device", "max_tokens": 12, **fields}
    return post(port, "/v1/completions", json.dumps(body).encode())


@pytest.mark.parametrize("extra", [(), ("--engine-process",)], ids=["in-process", "engine-process"])
def test_native_backend_samples_per_request_on_cuda(cache_dir, tmp_path, extra):
    port, log = free_port(), tmp_path / "serve.log"
    process = start(["-m", "kvplug", "serve", "--device", "cuda", "--kv-backend", "native", "--port", str(port),
                     "--max-seq-len", "512", *extra], cache_dir, log)
    try:
        wait_ready(process, port, log)
        greedy = [_complete(port, temperature=0) for _ in range(2)]
        assert [status for status, _ in greedy] == [200, 200], (greedy, log.read_text()[-4000:])
        assert greedy[0][1]["choices"][0]["text"] == greedy[1][1]["choices"][0]["text"]
        fields = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1234, "frequency_penalty": 0.3}
        seeded = [_complete(port, **fields) for _ in range(2)]
        statuses = [status for status, _ in seeded]
        if statuses == [400, 400]:  # refused, with the reason, in OpenAI's shape
            error = seeded[0][1]["error"]
            assert error["type"] and error["message"], seeded[0]
        else:
            assert statuses == [200, 200], (seeded, log.read_text()[-4000:])
            texts = [reply["choices"][0]["text"] for _, reply in seeded]
            assert texts[0] == texts[1], texts  # the seed decides the tokens
            assert seeded[0][1]["usage"]["completion_tokens"] > 0
        assert _complete(port, temperature=0)[0] == 200  # still serving
    finally:
        code, _ = stop(process)
    assert code == 0, log.read_text()[-4000:]
