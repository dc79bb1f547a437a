"""``kvplug serve --trust-request-chat-template``: a request's own chat template is used, and even
then it cannot hold up other routes: it is rendered off the event loop and its text is measured
before it is tokenised (issue 33 item 2). One real server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.serve_process import free_port, get_json, post, start, stop, wait_ready

HI = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    from kvplug_transformers.embedded_model import ensure_embedded_model

    cache_dir = tmp_path_factory.mktemp("kvplug-cache")
    ensure_embedded_model(cache_dir)
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    process = start(["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "16MiB", "--max-seq-len", "512",
                     "--trust-request-chat-template", "--log-level", "warning"], cache_dir, log)
    wait_ready(process, port, log)
    yield port
    code, _ = stop(process)
    output = log.read_text()
    assert code == 0 and "Traceback" not in output, output[-4000:]


def _chat(port: int, template: str | None) -> tuple[int, dict]:
    body = {"messages": HI, "max_tokens": 2}
    if template is not None:
        body["chat_template_kwargs"] = {"chat_template": template}
    return post(port, "/v1/chat/completions", json.dumps(body).encode())


def test_the_request_template_is_the_one_rendered(server):
    status, default = _chat(server, None)
    assert status == 200, default
    status, own = _chat(server, "{{ messages[0]['content'] }}")
    assert status == 200, own
    assert own["usage"]["prompt_tokens"] < default["usage"]["prompt_tokens"]


def test_a_broken_template_is_the_clients_error(server):
    status, answer = _chat(server, "{% for %}")
    assert status == 400 and "chat template" in answer["error"]["message"], answer


def test_an_exploding_template_is_refused_on_its_text_without_stalling_health(server):
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            start_time = time.monotonic()
            assert get_json(server, "/health", timeout=30)[0] == 200
            latencies.append(time.monotonic() - start_time)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    start_time = time.monotonic()
    try:
        answers = [_chat(server, "{{ 'x' * 30000000 }}") for _ in range(3)]
    finally:
        done.set()
        prober.join()
    elapsed = time.monotonic() - start_time
    for status, answer in answers:
        assert status == 400 and "maximum context length is 512" in answer["error"]["message"], answer
    assert elapsed < 60  # tokenising 30 M characters took 100 s before the text was measured first
    assert latencies and max(latencies) < 1.5, sorted(latencies)[-3:]
    assert _chat(server, None)[0] == 200
