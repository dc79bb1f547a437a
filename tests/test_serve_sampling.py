"""``kvplug serve`` honours each request's sampling (issue 29 item 2), whatever the checkpoint's
``generation_config.json`` says: one real server on a copy of the embedded model whose config
*samples* (``do_sample`` true, temperature 0.9, top_k 50), driven by the real ``openai`` client
with greedy, seeded and penalised requests sent concurrently, in-process and with
``--engine-process``. Greedy requests (``temperature: 0``)
must be token-identical to ``model.generate(do_sample=False)``, seeded ones reproducible (alone and
in a mixed batch), a request sent without sampling fields must sample (the checkpoint's default),
``stop`` strings cut the text (streaming or not) with ``finish_reason: "stop"``, and what the
server cannot honour is a 400 in OpenAI's error shape. Every test runs on both backends: with
``--kv-backend native`` (transformers' own cache) a request with sampling fields is sampled by
kvplug's sampler on transformers' logits, so greedy and seeded requests give the same tokens on
both (``test_native_and_kvplug_give_the_same_tokens``)."""

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


def _serve(model, cache_dir, tmp_path_factory, *flags: str):
    """Start ``kvplug serve`` on ``model`` with ``flags``; yields its port, then checks a clean stop."""
    for module in ("fastapi", "uvicorn", "openai"):
        pytest.importorskip(module)
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    process = start(
        ["-m", "kvplug", "serve", str(model), "--port", str(port), "--kv-memory", "4MiB", "--max-seq-len", "256",
         "--log-level", "warning", *flags],
        cache_dir, log,
    )
    try:
        wait_ready(process, port, log)
        yield port
    finally:
        code, _ = stop(process)
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]


BACKENDS = [(), ("--engine-process",), ("--kv-backend", "native"), ("--kv-backend", "native", "--engine-process")]


@pytest.fixture(scope="module", params=BACKENDS, ids=["kvplug", "kvplug-engine-process", "native",
                                                       "native-engine-process"])
def server(request, checkpoint, cache_dir, tmp_path_factory):
    """One server per backend and mode: in-process, and ``--engine-process`` (the settings travel
    with each request to the engine process's sampler)."""
    yield from _serve(checkpoint, cache_dir, tmp_path_factory, *request.param)


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


@pytest.fixture(scope="module", params=["greedy", "sampling"], ids=["greedy-checkpoint", "sampling-checkpoint"])
def both_backends(request, cache_dir, tmp_path_factory):
    """The embedded (greedy) checkpoint, and the sampling one (transformers' worker then runs its
    per-request temperature / top-k / top-p, which kvplug's rows set neutral), served by kvplug's
    cache and by transformers' own: ``(kvplug port, native port, checkpoint kind)``."""
    pytest.importorskip("transformers")
    from kvplug_transformers.embedded_model import ensure_embedded_model

    model = ensure_embedded_model(cache_dir) if request.param == "greedy" else request.getfixturevalue("checkpoint")
    kvplug = _serve(model, cache_dir, tmp_path_factory)
    native = _serve(model, cache_dir, tmp_path_factory, "--kv-backend", "native")
    ports = (next(kvplug), next(native))
    yield (*ports, request.param)
    for server_process in (native, kvplug):
        next(server_process, None)


SAME_ON_BOTH = [
    {"temperature": 0}, {"temperature": 0, "repetition_penalty": 1.8},
    {"temperature": 1.0, "seed": 1234}, {"temperature": 1.3, "top_p": 0.9, "seed": 5},
    {"temperature": 0.8, "top_k": 7, "min_p": 0.05, "seed": 11},
    {"temperature": 0.7, "seed": 3, "frequency_penalty": 1.5, "presence_penalty": 0.5},
]


def test_native_and_kvplug_give_the_same_tokens(both_backends):
    """One command line serves both sides of an A/B: greedy and seeded requests (penalised, top-k,
    top-p, min-p) give the same tokens on transformers' own cache as on kvplug's, sent one by one
    and concurrently (a seeded request's stream is its own whatever shares its batch)."""
    import openai

    clients = [openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
               for port in both_backends[:2]]
    unset = [{}] if both_backends[2] == "greedy" else []  # no field: the checkpoint's, greedy here on both
    jobs = [(prompt, sampling) for sampling in SAME_ON_BOTH + unset for prompt in PROMPTS[:3]]
    texts = []
    # a top-k cut on this random model's near-uniform logits moves with a batch's float rounding
    batch_invariant = [index for index, (_, sampling) in enumerate(jobs) if "top_k" not in sampling]
    for client in clients:
        alone = [_complete(client, prompt, **dict(sampling)) for prompt, sampling in jobs]
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            together = list(pool.map(lambda job: _complete(client, job[0], **dict(job[1])), jobs))
        assert [together[index] for index in batch_invariant] == [alone[index] for index in batch_invariant]
        texts.append(alone)
    assert texts[0] == texts[1]
    assert len(set(texts[1])) > len(PROMPTS[:3])  # the seeds and penalties did change the text


@pytest.fixture(scope="module")
def min_p_checkpoint(checkpoint, tmp_path_factory):
    """The sampling checkpoint with ``min_p`` in its generation_config.json: transformers' worker
    applies MinPLogitsWarper to every row (it has no per-request version)."""
    path = tmp_path_factory.mktemp("min-p-checkpoint") / "model"
    shutil.copytree(checkpoint, path)
    config_file = path / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "min_p": 0.05}))
    return path


@pytest.fixture(scope="module")
def native_min_p_server(min_p_checkpoint, cache_dir, tmp_path_factory):
    yield from _serve(min_p_checkpoint, cache_dir, tmp_path_factory, "--kv-backend", "native")


def test_native_refuses_what_transformers_applies_to_every_row(native_min_p_server):
    """A checkpoint processor without a per-request version (min-p) would reach the rows kvplug's
    sampler samples: a request with its own sampling is a 400 in OpenAI's shape naming its field,
    the processor and the way out; a request without sampling fields is served (the checkpoint's)."""
    port = native_min_p_server
    body = {"prompt": "The quick brown fox", "max_tokens": 4}
    status, reply = post(port, "/v1/completions", json.dumps(body).encode())
    assert status == 200 and reply["choices"][0]["finish_reason"] in ("length", "stop"), reply
    for fields, param in (({"temperature": 0}, "temperature"), ({"seed": 7}, "seed"), ({"stop": ["fox"]}, "stop"),
                          ({"frequency_penalty": 0.5}, "frequency_penalty")):
        status, reply = post(port, "/v1/completions", json.dumps({**body, **fields}).encode())
        assert status == 400, (fields, reply)
        error = reply["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (fields, reply)
        assert error["message"].startswith(f"{param} ") and "MinPLogitsWarper" in error["message"], error
        assert "--kv-backend kvplug" in error["message"], error
