"""``kvplug serve`` against bad, oversized and unsupported requests (issue 17 items 1, 2, 9; issue 18
items 1, 7): one real server (embedded model, ``--max-seq-len 256``, a small pool, an API key) and
the real ``openai`` client. Every refusal must be a 4xx naming the field or the limit, and the
server must keep serving afterwards (the batching worker alive, no page held at idle)."""

from __future__ import annotations

import json
import time

import pytest

from tests.serve_process import free_port, get_json, post, start, stop, wait_ready

MAX_SEQ_LEN = 256
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvplug-cache")


@pytest.fixture(scope="module")
def server(cache_dir, tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    from kvplug_transformers.embedded_model import ensure_embedded_model

    ensure_embedded_model(cache_dir)
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    process = start(
        ["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "4MiB", "--max-seq-len", str(MAX_SEQ_LEN),
         "--api-key", API_KEY, "--max-request-bytes", "1MiB", "--log-level", "warning"],
        cache_dir, log,
    )
    wait_ready(process, port, log, api_key=API_KEY)
    yield port, process, log
    code, seconds = stop(process)
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[0]}/v1", api_key=API_KEY, timeout=60, max_retries=0)


def _chat(port: int, body: dict | bytes, key: str | None = API_KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return post(port, "/v1/chat/completions", data, headers)


def _assert_serving(port: int, client) -> None:
    messages = [{"role": "user", "content": "still there?"}]
    reply = client.chat.completions.create(messages=messages, max_tokens=3, model="kvplug-default")
    assert reply.usage.completion_tokens >= 1
    status, stats = get_json(port, "/kvplug/stats", headers=AUTH)
    assert status == 200 and stats["worker"] == {"alive": True, "error": None}
    assert get_json(port, "/health") == (200, {"status": "ok"})


HI = [{"role": "user", "content": "hi"}]


def test_models_lists_the_served_name_and_requests_may_name_or_omit_it(server, client):
    port = server[0]
    models = client.models.list()
    assert [m.id for m in models.data] == ["kvplug-default"]
    assert client.models.retrieve("kvplug-default").id == "kvplug-default"
    named = client.chat.completions.create(model="kvplug-default", messages=HI, max_tokens=2)
    assert named.model == "kvplug-default"
    status, body = _chat(port, {"messages": HI, "max_tokens": 2})  # no model at all
    assert status == 200 and body["model"] == "kvplug-default"
    status, body = _chat(port, {"model": "gpt-4o", "messages": HI})
    assert status == 404 and "'gpt-4o' does not exist" in body["error"]["message"]
    assert "kvplug-default" in body["error"]["message"]


def test_model_management_routes_are_gone(server):
    port = server[0]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path, body in (("/reset", b"{}"), ("/load_model", b'{"model": "gpt2"}')):
        assert post(port, path, body, auth)[0] == 404, path
    assert get_json(port, "/health") == (200, {"status": "ok"})


def test_api_key_is_required_on_every_route_but_health(server):
    port = server[0]
    assert _chat(port, {"messages": HI}, key=None)[0] == 401
    status, body = _chat(port, {"messages": HI}, key="wrong")
    assert status == 401 and "--api-key" in body["error"]["message"]
    assert get_json(port, "/health")[0] == 200  # open, like vLLM's
    for path in ("/docs", "/redoc", "/openapi.json", "/kvplug/stats", "/metrics", "/v1/models"):
        assert get_json(port, path)[0] == 401, path
    status, schema = get_json(port, "/openapi.json", headers=AUTH)
    assert status == 200 and "/v1/chat/completions" in schema["paths"]


def test_prompt_longer_than_the_limit_is_refused_with_vllm_wording(server, client):
    import openai

    port = server[0]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="kvplug-default", messages=[{"role": "user", "content": "x" * 1200}])
    message = refused.value.body["message"] if isinstance(refused.value.body, dict) else str(refused.value)
    assert f"This model's maximum context length is {MAX_SEQ_LEN} tokens" in message and "--max-seq-len" in message
    # the same through streaming and the legacy and Responses endpoints
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="kvplug-default", messages=[{"role": "user", "content": "x" * 1200}], stream=True
        )
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="kvplug-default", prompt="y" * 300)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="kvplug-default", input="z" * 300)
    # 10,000 messages fit in the body but not in the context
    status, body = _chat(port, {"messages": [{"role": "user", "content": "hi"}] * 10_000})
    assert status == 400 and "maximum context length" in body["error"]["message"]
    _assert_serving(port, client)


def test_generation_stops_at_the_limit_with_finish_reason_length(server, client):
    port = server[0]
    for max_tokens in (2_000, 10**9, None):
        kwargs = {} if max_tokens is None else {"max_tokens": max_tokens}
        reply = client.chat.completions.create(model="kvplug-default", messages=HI, temperature=0, **kwargs)
        assert reply.usage.total_tokens <= MAX_SEQ_LEN
        if reply.choices[0].finish_reason == "length":
            assert reply.usage.total_tokens == MAX_SEQ_LEN
    # a prompt one token short of the limit: exactly one generated token fits
    one = client.chat.completions.create(model="kvplug-default", messages=[{"role": "user", "content": "a"}],
                                         max_tokens=1)
    prompt_len = one.usage.prompt_tokens
    content = "a" * (1 + MAX_SEQ_LEN - 1 - prompt_len)  # byte-level tokenizer: one token per byte
    messages = [{"role": "user", "content": content}]
    reply = client.chat.completions.create(model="kvplug-default", messages=messages, max_tokens=500)
    assert reply.usage.prompt_tokens == MAX_SEQ_LEN - 1 and reply.usage.completion_tokens == 1
    assert reply.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model="kvplug-default", messages=HI, max_tokens=10**6, stream=True)
    chunks = [chunk for chunk in stream if chunk.choices]
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    _assert_serving(port, client)


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({}, 400, "'messages' must be a non-empty list"),
        ({"messages": []}, 400, "'messages' must be a non-empty list"),
        ({"messages": "hi"}, 400, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "'messages[0].content' must be a string"),
        ({"messages": [{"role": "user"}]}, 400, "'messages[0].content'"),
        ({"messages": [{"content": "hi"}]}, 400, "'messages[0].role' must be one of"),
        ({"messages": ["hi"]}, 400, "'messages[0]' must be an object"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         400, "text part"),
        ({"messages": HI, "max_tokens": 0}, 400, "'max_tokens' must be an integer >= 1"),
        ({"messages": HI, "max_tokens": -1}, 400, "'max_tokens' must be an integer >= 1"),
        ({"messages": HI, "max_tokens": "abc"}, 400, "'max_tokens' must be an integer >= 1"),
        ({"messages": HI, "max_tokens": 2.5}, 400, "'max_tokens' must be an integer >= 1"),
        ({"messages": HI, "max_completion_tokens": 0}, 400, "'max_tokens' must be an integer >= 1"),
        ({"messages": HI, "n": 2}, 400, "n must be 1"),
        ({"messages": HI, "logprobs": True}, 400, "logprobs are not supported"),
        ({"messages": HI, "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"messages": HI, "temperature": "hot"}, 400, "'temperature' must be a number"),
        ({"messages": HI, "temperature": -1}, 400, "'temperature' must be a number"),
        ({"messages": HI, "top_p": 0}, 400, "'top_p' must be a number in (0, 1]"),
        ({"messages": HI, "stream": "yes"}, 400, "'stream' must be true or false"),
        ({"messages": HI, "stop": 3}, 400, "'stop' must be a string or a list of strings"),
        ({"messages": HI, "logit_bias": {"x": 1}}, 400, "'logit_bias'"),
        ({"messages": HI, "generation_config": "{not json"}, 400, "'generation_config'"),
        ({"messages": HI, "model": 7}, 400, "'model' must be a string"),
        ({"messages": HI, "bogus_field": 1}, 400, "unknown field 'bogus_field' for this endpoint"),
        ({"messages": HI, "seed": 2**70}, 400, "'seed' must be an integer in [0, 2**63)"),
        ({"messages": HI, "frequency_penalty": -3}, 400, "'frequency_penalty' must be a number in [-2, 2]"),
        ({"messages": HI, "presence_penalty": 2.5}, 400, "'presence_penalty' must be a number in [-2, 2]"),
        # what the server would not apply: refused, never ignored
        ({"messages": HI, "logit_bias": {"999999999": 5}}, 400, "'logit_bias' keys must be token ids in [0, "),
        ({"messages": HI, "stop": ["x" * 300]}, 400, "'stop' takes at most 16 strings of at most 256 characters"),
        ({"messages": HI, "generation_config": '{"num_beams": 4}'}, 400, "'generation_config.num_beams' 4 is not"),
    ],
)
def test_bad_chat_bodies_get_a_4xx_naming_the_field(server, body, status, words):
    got, answer = _chat(server[0], body)
    assert got == status, answer
    text = json.dumps(answer)
    assert words in text, text


def test_sampling_parameters_are_accepted(server, client):
    for extra in ({"temperature": 0}, {"frequency_penalty": 0}, {"n": 1}, {"seed": 7}, {"stop": []},
                  {"frequency_penalty": -1}, {"presence_penalty": 0.3}, {"stop": ["\n\n"]}, {"temperature": 0.8, "top_p": 0.5},
                  {"extra_body": {"generation_config": '{"do_sample": true, "top_k": -1}'}}):
        reply = client.chat.completions.create(model="kvplug-default", messages=HI, max_tokens=3, **extra)
        assert reply.choices[0].finish_reason in ("stop", "length"), extra
    status, answer = _chat(server[0], {"messages": HI, "max_completion_tokens": 2})
    assert status == 200 and answer["usage"]["completion_tokens"] <= 2


def test_bad_bodies_on_other_endpoints_and_non_json(server, client):
    port = server[0]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for body, words in (
        ({"prompt": ["a", ""]}, "'prompt[1]' must be a non-empty string"),
        ({"prompt": ""}, "'prompt' must be a non-empty string"),
        ({"prompt": "hi", "n": 3}, "n must be 1"),
        ({"prompt": "hi", "echo": True}, "echo is not supported"),
    ):
        status, answer = post(port, "/v1/completions", json.dumps(body).encode(), auth)
        assert status == 400 and words in answer["error"]["message"], answer
    for body, words in (
        ({"input": 5}, "'input' must be a non-empty string or list"),
        ({"input": []}, "'input' must be a non-empty string or list"),
        ({"input": [{"role": "user", "content": 3}]}, "'input[0].content' must be a string"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id is not supported"),
    ):
        status, answer = post(port, "/v1/responses", json.dumps(body).encode(), auth)
        assert status == 400 and words in answer["error"]["message"], answer
    assert _chat(port, b"{not json")[0] == 422
    assert _chat(port, b"[1, 2]")[0] == 422
    _assert_serving(port, client)


def test_huge_body_is_refused_with_413_before_parsing(server, client):
    port = server[0]
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * (20 << 20)}]}).encode()
    start_time = time.monotonic()
    status, answer = _chat(port, huge)
    assert status == 413 and "--max-request-bytes" in answer["error"]["message"]
    assert time.monotonic() - start_time < 30
    _assert_serving(port, client)


def test_completions_and_non_streaming_responses_work(server, client):
    completion = client.completions.create(model="kvplug-default", prompt="hello", max_tokens=4)
    assert completion.usage.completion_tokens >= 1 and completion.model == "kvplug-default"
    response = client.responses.create(model="kvplug-default", input="hello", max_output_tokens=4)
    assert response.status == "completed" and isinstance(response.output_text, str)
    assert response.model == "kvplug-default"
    streamed = list(client.responses.create(model="kvplug-default", input="hello", max_output_tokens=4, stream=True))
    assert streamed[-1].type == "response.completed"


def test_nothing_is_held_at_idle_afterwards(server, client):
    port = server[0]
    _assert_serving(port, client)
    time.sleep(0.3)
    status, stats = get_json(port, "/kvplug/stats", headers=AUTH)
    assert status == 200
    assert stats["running_requests"] == 0 and stats["in_flight"] == 0
    assert stats["used_pages"] == stats["cached_pages"], stats  # only the prefix cache holds pages
    assert stats["admitted_requests"] == stats["finished_requests"], stats
