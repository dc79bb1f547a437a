"""Per-request sampling on ``--kv-backend native`` in the worker (``native_sampling``, ``native_step_sampler``,
``native_installation``), without a server: a step with no request of its own sampling is
transformers' alone (nothing of the step is read); in a mixed step the rows of requests with their
own settings are kvplug's sampler's and the others the original's; ended requests are released;
what the worker cannot let kvplug sample is refused naming the field. The served behaviour (same
tokens as the kvplug backend, the 400s over HTTP) is ``tests/test_serve_sampling.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvplug_transformers.native_sampling import NativeRequestSampling  # noqa: E402
from kvplug_transformers.request_limits import RequestRefused  # noqa: E402
from kvplug_transformers.sampler import BatchSampler  # noqa: E402
from kvplug_transformers.sampling_params import SamplingParams  # noqa: E402

VOCAB = 32
RequestStatus = transformers.generation.continuous_batching.requests.RequestStatus


class _NoStep:
    """A runner whose step must not be looked at."""

    return_logprobs = False

    @property
    def inputs_and_outputs(self):
        raise AssertionError("the step was read although no request has its own sampling")


def _runner(states: list) -> SimpleNamespace:
    futures = [SimpleNamespace(state=state, has_new_token=True) for state in states]
    return SimpleNamespace(inputs_and_outputs=SimpleNamespace(requests_in_batch=futures), return_logprobs=False)


def _state(request_id: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, initial_tokens=[1, 2, 3], generated_tokens=[],
                           status=RequestStatus.DECODING, _new_tokens_limit=16, max_new_tokens=16)


def _sampling() -> NativeRequestSampling:
    return NativeRequestSampling(transformers.GenerationConfig(do_sample=False), VOCAB)


def _original(calls: list):
    def original(runner, scores, output_ids):
        calls.append(scores.shape[1])
        output_ids[0, : scores.shape[1]] = 7

    return original


def test_a_step_without_own_sampling_is_transformers_alone():
    sampling = _sampling()
    calls: list = []
    output_ids = torch.zeros(1, 5, dtype=torch.int32)
    sampling.step_sampler.sample(_NoStep(), torch.randn(1, 3, VOCAB), output_ids, _original(calls))
    assert calls == [3] and output_ids[0, :3].tolist() == [7, 7, 7] and sampling.step_sampler.tracked == 0


def test_a_mixed_step_samples_own_rows_with_kvplug_and_the_rest_with_the_original():
    sampling = _sampling()
    own = SamplingParams(temperature=1.0, seed=42)
    sampling.register("a", own)
    states = [_state("x"), _state("a")]
    scores = torch.randn(1, 2, VOCAB)
    calls: list = []
    output_ids = torch.zeros(1, 4, dtype=torch.int32)
    sampling.step_sampler.sample(_runner(states), scores, output_ids, _original(calls))
    reference = BatchSampler(lambda _: own, VOCAB, torch.device("cpu"))
    expected, _ = reference.sample(["a"], lambda _: [1, 2, 3], scores[0, 1:2])
    assert calls == [2]  # the other row: transformers'
    assert output_ids[0, 0].item() == 7 and output_ids[0, 1].item() == expected.item()
    assert sampling.step_sampler.tracked == 1 and not sampling.has("a")  # taken by the sampler
    states[1].status = RequestStatus.FINISHED
    sampling.step_sampler.sample(_runner([states[0]]), scores[:, :1], output_ids, _original(calls))
    assert sampling.step_sampler.tracked == 0  # released at the next step


def test_a_step_of_own_rows_only_skips_the_original():
    sampling = _sampling()
    own = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    sampling.register("a", own)
    calls: list = []
    output_ids = torch.zeros(1, 4, dtype=torch.int32)
    scores = torch.randn(1, 1, VOCAB)
    sampling.step_sampler.sample(_runner([_state("a")]), scores, output_ids, _original(calls))
    expected, _ = BatchSampler(lambda _: own, VOCAB, torch.device("cpu")).sample(["a"], lambda _: [1, 2, 3], scores[0])
    assert calls == [] and output_ids[0, 0].item() == expected.item()
    sampling.step_sampler.cancel("a")
    sampling.step_sampler.sample(_runner([]), scores[:, :0], output_ids, _original(calls))
    assert sampling.step_sampler.tracked == 0  # a cancelled request is released at the next step


def test_admit_registers_only_other_sampling_and_refuses_what_the_worker_cannot_let_kvplug_do():
    sampling = _sampling()
    assert sampling.admit(sampling.defaults) is None  # the checkpoint's own: transformers samples it
    seeded = SamplingParams(temperature=0.7, seed=3)
    assert sampling.admit(seeded) is seeded
    sampling.fixed = ("MinPLogitsWarper",)
    with pytest.raises(RequestRefused) as caught:
        sampling.admit(seeded)
    assert caught.value.param == "temperature" and "MinPLogitsWarper" in str(caught.value)
    assert sampling.admit(sampling.defaults) is None  # still served
    sampling.fixed, sampling.worker_limit = (), "transformers' CUDA graphs of its step replay the sampling"
    with pytest.raises(RequestRefused, match="CUDA graphs"):
        sampling.admit(SamplingParams(stop=("x",)))


def test_the_worker_processors_are_read_as_transformers_builds_them():
    """A sampling config: per-request temperature / top-k / top-p (set neutral for kvplug's rows);
    min_p has no per-request version and applies to every row."""
    from kvplug_transformers.native_sampling import worker_processors

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config = transformers.GenerationConfig(do_sample=True, temperature=0.9, top_k=5, top_p=0.9,
                                                            min_p=0.1)
    fixed, keys = worker_processors(model)
    assert fixed == ("MinPLogitsWarper",) and keys == {"temperature", "top_k", "top_p"}
    sampling = NativeRequestSampling(model.generation_config, VOCAB, model=model)
    assert sampling.neutral == {"temperature": 1.0, "top_p": 1.0, "top_k": VOCAB}
