"""Per-request sampling in transformers' continuous batching on kvplug (in process, CPU): a tiny Qwen3
whose generation config *samples* (do_sample, temperature 0.9), run through ``generate_batch`` with
``TransformersHost.sample_per_request``. Requests registered with ``temperature: 0`` must give
exactly ``model.generate(do_sample=False)``'s tokens; unregistered ones get the checkpoint's
sampling (not greedy); a seeded request gives the same tokens alone and among other requests."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvplug_transformers import compat  # noqa: E402
from kvplug_transformers.host import TransformersHost  # noqa: E402
from kvplug_transformers.request_sampling import RequestSampling  # noqa: E402
from kvplug_transformers.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(
    not compat.is_supported_version(transformers.__version__),
    reason=f"kvplug-transformers supports transformers {compat.SUPPORTED_RANGE}",
)

MAX_NEW_TOKENS = 12
PROMPTS = [[1, *range(5, 40)], [2, 3, 4], list(range(70, 100)), [7], [1, *range(5, 30), 90, 91]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(4321)
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=0, pad_token_id=0,
        bos_token_id=1, initializer_range=0.2,
    )
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.generation_config = transformers.GenerationConfig(
        do_sample=True, temperature=0.9, top_k=40, eos_token_id=0, pad_token_id=0, max_new_tokens=MAX_NEW_TOKENS
    )
    return model


def _greedy(model, prompt):
    config = transformers.GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=0,
                                           pad_token_id=0)
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()


def _run(model, prompts, params: list[SamplingParams | None], max_batch_tokens: int = 64,
         **settings) -> tuple[list[list[int]], RequestSampling]:
    """``generate_batch`` on kvplug with per-request sampling; ``params[i]`` registered for the
    i-th request (transformers names them ``req_0``, ``req_1`` ... in a fresh manager)."""
    sampling = RequestSampling(model.generation_config, model.config.vocab_size)
    for index, value in enumerate(params):
        if value is not None:
            sampling.register(f"req_{index}", value)
    host = TransformersHost(max_seq_len=256, num_pages=64, page_size=16)
    config = sampling.config(model)
    config.max_new_tokens = MAX_NEW_TOKENS
    with host.installed_context(**settings):
        host.sample_per_request(sampling)
        outputs = model.generate_batch(
            prompts, generation_config=config,
            continuous_batching_config=transformers.ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens),
        )
    assert sorted(outputs) == [f"req_{index}" for index in range(len(prompts))]
    assert all(outputs[f"req_{index}"].error is None for index in range(len(prompts)))
    return [outputs[f"req_{index}"].generated_tokens for index in range(len(prompts))], sampling


def test_temperature_zero_is_greedy_generate_on_a_sampling_checkpoint(model):
    tokens, sampling = _run(model, PROMPTS, [SamplingParams(temperature=0.0)] * len(PROMPTS))
    assert tokens == [_greedy(model, prompt) for prompt in PROMPTS]
    assert sampling.waiting == 0  # every registration was taken by the worker


def test_unregistered_requests_get_the_checkpoint_sampling(model):
    torch.manual_seed(0)
    tokens, _ = _run(model, PROMPTS, [None] * len(PROMPTS))
    assert tokens != [_greedy(model, prompt) for prompt in PROMPTS]


def test_a_seeded_request_repeats_alone_and_in_a_batch(model):
    seeded = SamplingParams(temperature=1.2, top_p=0.9, seed=2026)
    alone, _ = _run(model, [PROMPTS[0]], [seeded])
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[4]]
    mixed, _ = _run(model, prompts, [SamplingParams(temperature=1.0), SamplingParams(), seeded,
                                     SamplingParams(temperature=0.8, presence_penalty=1.0), None])
    reordered, _ = _run(model, [PROMPTS[3], PROMPTS[0]], [SamplingParams(temperature=1.5), seeded])
    assert mixed[2] == alone[0] == reordered[1]
    assert mixed[1] == _greedy(model, PROMPTS[2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("overlap", [None, False], ids=["overlap", "sync"])
def test_cuda_graph_replays_sample_per_request(model, overlap, monkeypatch):
    """On CUDA decode steps replay kvplug's graphs and are sampled after the replay, on the graph's
    logits: greedy rows still equal ``generate``, a seed still repeats across batch compositions
    (with transformers' async batching and without)."""
    from kvplug_transformers.decode_graphs import HostDecodeGraphs

    replays = []
    run_step = HostDecodeGraphs.run_step

    def counting(self, runner, graph_model, batch_data):
        replayed = run_step(self, runner, graph_model, batch_data)
        replays.append(replayed)
        return replayed

    monkeypatch.setattr(HostDecodeGraphs, "run_step", counting)
    references = [_greedy(model, prompt) for prompt in PROMPTS]
    seeded = SamplingParams(temperature=1.2, top_p=0.9, top_k=30, seed=77)
    settings = dict(max_batch_tokens=256, attention="torch", cuda_graph_batch_sizes=(1, 2, 4, 8),
                    overlap_schedule=overlap)
    model.to("cuda")
    try:
        greedy, _ = _run(model, PROMPTS, [SamplingParams(temperature=0.0)] * len(PROMPTS), **settings)
        alone, _ = _run(model, [PROMPTS[0]], [seeded], **settings)
        mixed, _ = _run(model, [PROMPTS[2], PROMPTS[0], PROMPTS[1]],
                        [SamplingParams(temperature=1.0, frequency_penalty=0.5), seeded, SamplingParams()], **settings)
    finally:
        model.to("cpu")
    assert greedy == references
    assert mixed[1] == alone[0]
    assert mixed[2] == references[1]
    assert sum(replays) >= 5


def test_a_worker_with_logits_processors_is_refused(model):
    """Per-request sampling on a worker whose config adds transformers' processors would apply
    them twice: the request fails with kvplug's explanation instead."""
    sampling = RequestSampling(model.generation_config, model.config.vocab_size)
    host = TransformersHost(max_seq_len=256, num_pages=64, page_size=16)
    config = transformers.GenerationConfig(do_sample=True, temperature=0.7, max_new_tokens=2, eos_token_id=0,
                                           pad_token_id=0)
    with host.installed_context():
        host.sample_per_request(sampling)
        outputs = model.generate_batch([PROMPTS[1]], generation_config=config)
    errors = [output.error for output in outputs.values()]
    assert errors and all(error and "without logits processors" in error for error in errors), errors
