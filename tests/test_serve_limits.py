"""The per-request rules of ``kvplug serve`` on their own (no server): ``RequestLimits`` against a
direct statement of the rule for every prompt length and ``max_tokens`` of a small limit,
``ServerSampling``'s notion of "the same sampling", and the body checks' normalisations."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kvplug.interface import InvalidArgumentError  # noqa: E402
from kvplug_transformers.request_bodies import check_chat_completion, check_response  # noqa: E402
from kvplug_transformers.request_limits import RequestLimits, RequestRefused  # noqa: E402
from kvplug_transformers.worker_watch import ServerSampling  # noqa: E402


def test_limits_match_the_rule_for_every_prompt_and_max_tokens():
    limit = 12
    limits = RequestLimits(limit, "--max-seq-len 12")
    for prompt_len in range(0, limit + 3):
        for requested in (None, *range(1, limit + 3), 10**9):
            if prompt_len == 0 or prompt_len >= limit:
                with pytest.raises(RequestRefused) as refused:
                    limits.admit(prompt_len, requested)
                assert refused.value.status == 400 and refused.value.param == "messages"
                continue
            granted = limits.admit(prompt_len, requested)
            room = limit - prompt_len
            assert granted == (room if requested is None else min(requested, room))
            assert 1 <= granted and prompt_len + granted <= limit


def test_refusal_names_the_limit_in_vllm_words():
    with pytest.raises(RequestRefused) as refused:
        RequestLimits(1024, "--max-seq-len 1024").admit(1119, 16)
    text = str(refused.value)
    assert text.startswith("This model's maximum context length is 1024 tokens. However, you requested 1119 tokens")
    assert "--max-seq-len 1024" in text
    assert refused.value.to_json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(InvalidArgumentError):
        RequestLimits(1, "x")


class _Config:
    def __init__(self, **fields):
        self.__dict__.update(
            {"do_sample": False, "temperature": None, "top_p": None, "top_k": None, "repetition_penalty": None,
             "sequence_bias": None, "stop_strings": None, "num_beams": 1, "num_return_sequences": 1, **fields}
        )


class _Model:
    def __init__(self, **fields):
        self.generation_config = _Config(**fields)


def test_server_sampling_accepts_equivalent_settings_and_refuses_others():
    greedy = ServerSampling()
    model = _Model()
    for same in (_Config(), _Config(temperature=0.0), _Config(temperature=0.7), _Config(repetition_penalty=1.0),
                 _Config(stop_strings=[]), _Config(do_sample=True, temperature=0)):
        greedy.check(model, same)
    for other, name in ((_Config(do_sample=True, temperature=0.7), "do_sample"),
                        (_Config(repetition_penalty=1.2), "frequency_penalty"),
                        (_Config(sequence_bias={(5,): 1.0}), "logit_bias"),
                        (_Config(stop_strings=["x"]), "stop"), (_Config(num_beams=4), "num_beams")):
        with pytest.raises(RequestRefused) as refused:
            greedy.check(model, other)
        assert name in str(refused.value) and "greedy" in str(refused.value)
    sampled = ServerSampling()
    model = _Model(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    sampled.check(model, _Config(do_sample=True, temperature=0.6, top_p=0.95, top_k=20))
    with pytest.raises(RequestRefused, match="temperature 0.6, top_p 0.95, top_k 20"):
        sampled.check(model, _Config(do_sample=False))
    assert sampled.config(model).use_cache is False and model.generation_config.__dict__.get("use_cache") is None


def test_body_checks_normalise_what_transformers_would_misread():
    body = {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_completion_tokens": 5, "logit_bias": {"7": 1}}
    check_chat_completion(body)
    assert body["max_tokens"] == 5 and "max_completion_tokens" not in body
    assert body["messages"][0]["role"] == "system" and body["logit_bias"] == {"7": 1.0}
    with pytest.raises(RequestRefused, match="disagree"):
        check_chat_completion(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "max_completion_tokens": 4}
        )
    response = {"input": "hi"}
    check_response(response)
    assert response["stream"] is False  # OpenAI's default; transformers' handler would stream
