"""vLLM's ``/tokenize``, ``/detokenize`` and ``/version`` on a real ``kvplug serve`` (issue 29 item 4),
checked against the served model's own tokenizer."""

from __future__ import annotations

import json

import pytest

from tests.serve_process import get_json, post, start, stop, wait_ready, free_port

pytest.importorskip("fastapi")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvplug_transformers.embedded_model import ensure_embedded_model

    cache_dir = tmp_path_factory.mktemp("kvplug-cache")
    model = ensure_embedded_model(cache_dir)
    port, log = free_port(), tmp_path_factory.mktemp("log") / "serve.log"
    process = start(["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "4MiB", "--max-seq-len", "256"],
                    cache_dir, log)
    try:
        wait_ready(process, port, log)
        yield port, model
    finally:
        code, _ = stop(process)
        assert code == 0, log.read_text()[-3000:]


def _post(port, path, body):
    return post(port, path, json.dumps(body).encode())


def test_tokenize_and_detokenize_agree_with_the_model_tokenizer(server):
    from transformers import AutoTokenizer

    port, model = server
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = "KV caches page their memory."
    status, reply = _post(port, "/tokenize", {"prompt": text})
    expected = tokenizer(text)["input_ids"]
    assert status == 200 and reply == {"tokens": expected, "count": len(expected), "max_model_len": 256}
    status, reply = _post(port, "/detokenize", {"tokens": expected, "model": "kvplug-default"})
    assert status == 200 and reply == {"prompt": tokenizer.decode(expected)}
    messages = [{"role": "user", "content": "hi"}]
    status, reply = _post(port, "/tokenize", {"messages": messages})
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]
    assert status == 200 and reply["tokens"] == list(templated)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
])
def test_bad_fields_get_openai_errors_naming_them(server, path, body, status, param):
    got, reply = _post(server[0], path, body)
    assert got == status and reply["error"]["param"] == param and reply["error"]["code"] == status, reply


def test_version_is_kvplugs(server):
    import kvplug

    assert get_json(server[0], "/version") == (200, {"version": kvplug.__version__})
