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


def _scrape(port) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


def test_metrics_speak_vllms_names_and_count_what_was_served(server):
    import openai

    port = server[0]
    label = '{model_name="kvplug-default"}'
    before = _scrape(port)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert name + label in before, name
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    prompt = "Tell me about paged KV caches. " * 4
    for _ in range(2):  # the second finds the first's prompt in the prefix cache
        client.completions.create(model="kvplug-default", prompt=prompt, max_tokens=3)
    stream = client.chat.completions.create(model="kvplug-default", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=8, stream=True)
    chunks = [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert len(chunks) >= 2, chunks  # (the embedded model's greedy reply to this prompt is 8 tokens long)
    after = _scrape(port)
    e2e, ttft, tpot = ("vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
                       "vllm:time_per_output_token_seconds_count")
    assert after[e2e + label] - before[e2e + label] == 3  # every response
    assert after[ttft + label] - before[ttft + label] == 1  # the streamed one
    assert after[tpot + label] - before[tpot + label] >= 1
    queries = "vllm:prefix_cache_queries_total" + label
    assert after[queries] > before[queries]
    assert after["vllm:prefix_cache_hits_total" + label] > before["vllm:prefix_cache_hits_total" + label]  # 2nd hit
    assert after["vllm:num_requests_running" + label] == 0 and 0 <= after["vllm:kv_cache_usage_perc" + label] <= 1
    buckets = sorted((k, v) for k, v in after.items() if k.startswith("vllm:time_to_first_token_seconds_bucket"))
    assert buckets and all(v <= after[ttft + label] for _, v in buckets)


def test_completions_take_token_ids_and_a_list_of_one_prompt(server):
    """Benchmark clients send token ids and lists of prompts (issue 29 item 4): the same prompt as
    text, as its ids, and as a list of one gets the same greedy completion."""
    from transformers import AutoTokenizer

    port, model = server
    text = "Explain radix trees in one line."
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    replies = {}
    for name, prompt in (("text", text), ("ids", ids), ("[text]", [text]), ("[ids]", [ids])):
        status, reply = _post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0})
        assert status == 200, (name, reply)
        replies[name] = (reply["choices"][0]["text"], reply["usage"]["prompt_tokens"])
    assert len(set(replies.values())) == 1, replies
    assert replies["ids"][1] == len(ids)


@pytest.mark.parametrize(("prompt", "message"), [
    (["a", []], "'prompt[1]' must be a non-empty string"),
    ([[1, 2], [10**9]], "token ids outside the vocabulary"),  # one prompt of several fails the request
    (["a"] * 1025, "at most 1024 per request"),
    ([10**9], "token ids outside the vocabulary"),
    ([], "'prompt' must be a non-empty string, a non-empty list of token ids"),
    ([1, "a"], "'prompt' must be a non-empty string"),
])
def test_prompts_that_cannot_be_served_get_400_naming_prompt(server, prompt, message):
    status, reply = _post(server[0], "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 400 and reply["error"]["param"] == "prompt" and message in reply["error"]["message"], reply


@pytest.mark.parametrize(("field", "value", "status"), [
    ("top_k", 5, 200), ("min_p", 0.1, 200), ("repetition_penalty", 1.3, 200), ("top_k", -1, 200), ("min_p", 0, 200),
    ("repetition_penalty", 1.0, 200),
    ("top_k", -5, 400), ("min_p", 1.5, 400), ("repetition_penalty", 0, 400), ("no_such_field", 1, 400),
])
def test_vllm_sampling_extras_are_honoured_or_refused_in_openai_shape(server, field, value, status):
    """vLLM's sampling fields beyond OpenAI's are applied (issue 29 item 2); a bad value or an
    unknown field is not transformers' 422 ``{"detail": ...}`` but a 400 in OpenAI's shape naming it."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    got, reply = _post(server[0], "/v1/chat/completions", body)
    assert got == status, reply
    if status == 400:
        assert reply["error"]["param"] == field and reply["error"]["type"] == "invalid_request_error", reply


def test_a_greedy_checkpoint_samples_when_asked(server):
    """The embedded model's generation_config.json decodes greedily: temperature 1.5 was served
    200 and ignored (issue 29 item 2). Now it samples (a seed reproducibly), while leaving it out or
    sending 0 stays greedy."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        def text(**sampling):
            got, reply = _post(server[0], path, {**body, "max_tokens": 16, **sampling})
            assert got == 200, reply
            choice = reply["choices"][0]
            return choice["message"]["content"] if "message" in choice else choice["text"]

        greedy = text()
        assert text(temperature=0) == greedy
        sampled = {seed: text(temperature=1.5, top_p=0.95, seed=seed) for seed in range(4)}
        assert any(value != greedy for value in sampled.values()), (path, sampled)
        assert text(temperature=1.5, top_p=0.95, seed=2) == sampled[2]
