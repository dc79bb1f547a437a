"""``kvplug serve`` honours each request's sampling (issue 29 item 2), whatever the checkpoint's
``generation_config.json`` says: one real server on a copy of the embedded model whose config
*samples* (``do_sample`` true, temperature 0.9, top_k 50), driven by the real ``openai`` client
with greedy, seeded and penalised requests sent concurrently, in-process and with
``--engine-process``. Greedy requests (``temperature: 0``)
must be token-identical to ``model.generate(do_sample=False)``, seeded ones reproducible (alone and
in a mixed batch), a request sent without sampling fields must sample (the checkpoint's default),
``stop`` strings cut the text (streaming or not) with ``finish_reason: "stop"``, and what the
server cannot honour is a 400 in OpenAI's error shape."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve_process import free_port, post, start, stop, wait_ready

MAX_TOKENS = 24
PROMPTS = ["The quick brown fox", "kvplug pages", "Once upon a time", "0123456789", "sampling per request"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvplug-cache")


@pytest.fixture(scope="module")
def checkpoint(cache_dir, tmp_path_factory):
    """The embedded model, its generation_config.json made to sample (as real chat checkpoints do)."""
    pytest.importorskip("transformers")
    from kvplug_transformers.embedded_model import ensure_embedded_model

    path = tmp_path_factory.mktemp("sampling-checkpoint") / "model"
    shutil.copytree(ensure_embedded_model(cache_dir), path)
    config_file = path / "generation_config.json"
    config = json.loads(config_file.read_text())
    config.update(do_sample=True, temperature=0.9, top_k=50, top_p=0.95)
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=[(), ("--engine-process",)], ids=["in-process", "engine-process"])
def server(request, checkpoint, cache_dir, tmp_path_factory):
    """One server per mode: in-process, and ``--engine-process`` (the settings travel with each
    request to the engine process's sampler)."""
    for module in ("fastapi", "uvicorn", "openai"):
        pytest.importorskip(module)
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    process = start(
        ["-m", "kvplug", "serve", str(checkpoint), "--port", str(port), "--kv-memory", "4MiB", "--max-seq-len", "256",
         "--log-level", "warning", *request.param],
        cache_dir, log,
    )
    wait_ready(process, port, log)
    yield port
    code, _ = stop(process)
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def greedy_references(checkpoint):
    """``model.generate`` with ``do_sample=False`` over each prompt: what temperature 0 must give."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    config = transformers.GenerationConfig(
        max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    references = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            out = model.generate(ids, generation_config=config)[0, ids.shape[1]:]
            references[prompt] = tokenizer.decode(out, skip_special_tokens=True)
    return references


def _complete(client, prompt: str, **sampling) -> str:
    extra = {key: sampling.pop(key) for key in ("top_k", "min_p", "repetition_penalty") if key in sampling}
    reply = client.completions.create(model=_model(client), prompt=prompt, max_tokens=MAX_TOKENS,
                                      extra_body=extra or None, **sampling)
    return reply.choices[0].text


def _model(client) -> str:
    return client.models.list().data[0].id


def test_temperature_zero_is_greedy_on_a_sampling_checkpoint(client, greedy_references):
    for prompt in PROMPTS:
        assert _complete(client, prompt, temperature=0) == greedy_references[prompt], prompt


def test_the_checkpoint_default_samples(client, greedy_references):
    """No sampling field: the checkpoint's sampling (temperature 0.9, top_k 50), not greedy."""
    replies = [_complete(client, prompt) for prompt in PROMPTS for _ in range(2)]
    greedy = [greedy_references[prompt] for prompt in PROMPTS for _ in range(2)]
    assert replies != greedy


def test_mixed_sampling_requests_concurrently(client, greedy_references):
    """Greedy, seeded, penalised and top-k/top-p/min-p requests in one batch: greedy rows stay
    token-identical to generate, a seed gives the same text alone and among the others."""
    seeded = {"temperature": 1.0, "seed": 1234, "top_p": 0.9}
    alone = _complete(client, PROMPTS[0], **dict(seeded))
    assert alone == _complete(client, PROMPTS[0], **dict(seeded))  # reproducible, sequentially
    jobs = []
    for round_index in range(2):
        for prompt in PROMPTS:
            jobs.append(("greedy", prompt, {"temperature": 0}))
        jobs.append(("seeded", PROMPTS[0], dict(seeded)))
        jobs.append(("other", PROMPTS[1], {"temperature": 1.3, "top_k": 5, "min_p": 0.05, "seed": round_index}))
        jobs.append(("other", PROMPTS[2], {"temperature": 0.7, "frequency_penalty": 1.5, "presence_penalty": 0.5}))
        jobs.append(("other", PROMPTS[3], {"temperature": 0, "repetition_penalty": 1.8}))
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(lambda job: (job, _complete(client, job[1], **dict(job[2]))), jobs))
    for (kind, prompt, _), text in results:
        if kind == "greedy":
            assert text == greedy_references[prompt], prompt
        elif kind == "seeded":
            assert text == alone
    # a penalty changes what greedy decoding picks (the embedded model repeats itself)
    penalised = [text for (kind, prompt, sampling), text in results if sampling.get("repetition_penalty")]
    assert penalised[0] == penalised[1] != greedy_references[PROMPTS[3]]


def test_different_seeds_differ_and_the_same_seed_repeats(client):
    texts = {seed: _complete(client, PROMPTS[4], temperature=1.5, seed=seed) for seed in (1, 2, 3)}
    assert len(set(texts.values())) > 1
    assert _complete(client, PROMPTS[4], temperature=1.5, seed=2) == texts[2]


def test_chat_sampling_fields_are_honoured(client):
    messages = [{"role": "user", "content": "hello"}]
    replies = [
        client.chat.completions.create(model=_model(client), messages=messages, max_tokens=12, temperature=1.0,
                                       seed=99, frequency_penalty=0.5, logit_bias={"65": 5})
        .choices[0].message.content
        for _ in range(2)
    ]
    assert replies[0] == replies[1]


@pytest.mark.parametrize("body, param", [
    ({"stop": ["x" * 300]}, "stop"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"generation_config": json.dumps({"num_beams": 2})}, "generation_config"),
])
def test_what_cannot_be_honoured_is_a_400_in_openai_shape(server, body, param):
    status, reply = post(server, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, **body}).encode())
    assert status == 400, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["param"] == param, reply



@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_strings_end_the_text_before_them(client, greedy_references, stream):
    """A stop string taken from the middle of the greedy text: the reply is the text before its
    first occurrence, ``finish_reason`` is ``"stop"``, and generation ended early."""
    prompt = next(p for p in PROMPTS if len(greedy_references[p]) >= 12)
    full = greedy_references[prompt]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[: full.find(stop)]
    model = _model(client)
    if stream:
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stop=[stop, "\u0000never"], stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
        assert text == expected and finish == ["stop"], (text, expected, finish)
    else:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          stop=stop)
        assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens < MAX_TOKENS


@pytest.fixture(scope="module", params=["sampling", "greedy"], ids=["sampling-checkpoint", "greedy-checkpoint"])
def native_server(request, checkpoint, cache_dir, tmp_path_factory):
    """``--kv-backend native`` (transformers' own cache, one sampling setting for the worker) on
    the sampling checkpoint and on the embedded greedy one: ``(port, checkpoint kind)``."""
    for module in ("fastapi", "uvicorn"):
        pytest.importorskip(module)
    from kvplug_transformers.embedded_model import ensure_embedded_model

    model = checkpoint if request.param == "sampling" else ensure_embedded_model(cache_dir)
    port, log = free_port(), tmp_path_factory.mktemp("serve-native") / "serve.log"
    process = start(
        ["-m", "kvplug", "serve", str(model), "--port", str(port), "--kv-backend", "native", "--kv-memory", "4MiB",
         "--max-seq-len", "256", "--log-level", "warning"],
        cache_dir, log,
    )
    wait_ready(process, port, log)
    yield port, request.param
    code, _ = stop(process)
    assert code == 0, log.read_text()[-4000:]


def _native_post(port: int, body: dict) -> tuple[int, dict]:
    return post(port, "/v1/completions", json.dumps({"prompt": "The quick brown fox", "max_tokens": 4, **body}).encode())


NATIVE_SERVED = {
    # what the worker does anyway: the checkpoint's own settings, or fields that play no part
    "sampling": [{}, {"temperature": 0.9, "top_p": 0.95, "top_k": 50}, {"frequency_penalty": 0, "stop": []},
                 {"min_p": 0, "repetition_penalty": 1}],
    "greedy": [{}, {"temperature": 0}, {"temperature": 0, "top_p": 0.5, "top_k": 5, "seed": 3},
               {"top_k": -1, "min_p": 0, "frequency_penalty": 0, "presence_penalty": 0}],
}
NATIVE_REFUSED = {
    "sampling": [({"temperature": 0}, "temperature"), ({"temperature": 0.5}, "temperature"), ({"top_p": 0.5}, "top_p"),
                 ({"top_k": -1}, "top_k"), ({"seed": 7}, "seed"), ({"min_p": 0.1}, "min_p")],
    "greedy": [({"temperature": 0.7}, "temperature"), ({"top_p": 0.5}, "top_p"), ({"top_k": 5}, "top_k"),
               ({"repetition_penalty": 1.3, "temperature": 0}, "repetition_penalty")],
    "both": [({"frequency_penalty": 0.5}, "frequency_penalty"), ({"presence_penalty": 0.3}, "presence_penalty"),
             ({"stop": ["fox"]}, "stop"), ({"logit_bias": {"5": 1}}, "logit_bias")],
}


def test_native_serves_what_its_worker_does_anyway(native_server):
    """The checkpoint's own settings, and fields that play no part (top_p with temperature 0 on a
    greedy checkpoint, vLLM's "off" values), are served."""
    port, kind = native_server
    for body in NATIVE_SERVED[kind]:
        status, reply = _native_post(port, body)
        assert status == 200 and reply["choices"][0]["finish_reason"] in ("length", "stop"), (body, reply)


def test_native_refuses_other_sampling_naming_the_field_and_the_way_out(native_server):
    """transformers' continuous batching samples every request with the worker's one config: any
    other sampling is a 400 in OpenAI's shape naming the field the client sent (not transformers'
    translation of it), the server's setting and ``--kv-backend kvplug``; never served with
    settings the request did not ask for (``temperature: 0`` on a sampling checkpoint included)."""
    port, kind = native_server
    setting = "temperature 0.9, top_p 0.95, top_k 50" if kind == "sampling" else "(greedy)"
    for body, param in NATIVE_REFUSED[kind] + NATIVE_REFUSED["both"]:
        status, reply = _native_post(port, body)
        assert status == 400, (body, reply)
        error = reply["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (body, reply)
        message = error["message"]
        assert message.startswith(f"{param} ") and "--kv-backend kvplug" in message, message
        assert setting.strip("()") in message and "repetition_penalty 1.5" not in message, message
