"""kvplug's batched sampler (``kvplug_transformers.sampler``) against a straightforward per-row
reference: each row's distribution after logit bias, penalties, temperature, min-p, top-k and top-p
is computed by a plain loop; the vectorised pass must draw from exactly that support with those
frequencies, greedy rows must take the penalised argmax, and a seed must give the same tokens
whatever else is in the batch. CPU only."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

from kvplug_transformers.sampler import BatchSampler, RowPenalties, RowParams, sample_rows  # noqa: E402
from kvplug_transformers.sampling_params import SamplingParams, checkpoint_defaults  # noqa: E402

VOCAB = 12


def reference_probs(logits: list[float], params: SamplingParams, prompt: list[int], generated: list[int]) -> list[float]:
    """One row's distribution, written out token by token (vLLM's order and meaning)."""
    x = [float(v) for v in logits]
    for token, bias in params.logit_bias:
        x[token] += bias
    counts = Counter(generated)
    for token in range(len(x)):
        if token in counts or token in prompt:
            x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
        x[token] -= params.frequency_penalty * counts.get(token, 0) + params.presence_penalty * (token in counts)
    if params.greedy:
        best = max(range(len(x)), key=lambda t: x[t])
        return [1.0 if t == best else 0.0 for t in range(len(x))]
    x = [v / params.temperature for v in x]

    def softmax(values: dict[int, float]) -> dict[int, float]:
        top = max(values.values())
        exp = {t: math.exp(v - top) for t, v in values.items()}
        total = sum(exp.values())
        return {t: e / total for t, e in exp.items()}

    kept = dict(enumerate(x))
    if params.min_p > 0:
        probs = softmax(kept)
        floor = max(probs.values()) * params.min_p
        kept = {t: v for t, v in kept.items() if probs[t] >= floor}
    ranked = sorted(kept, key=lambda t: -kept[t])
    if params.top_k > 0:
        ranked = ranked[: params.top_k]
        kept = {t: kept[t] for t in ranked}
    if params.top_p < 1:
        probs, nucleus, before = softmax(kept), [], 0.0
        for token in ranked:
            if before >= params.top_p:
                break
            nucleus.append(token)
            before += probs[token]
        kept = {t: kept[t] for t in nucleus}
    probs = softmax(kept)
    return [probs.get(t, 0.0) for t in range(len(x))]


def _row_params(settings: list[SamplingParams], prompts: list[list[int]], generated: list[list[int]],
                noise: torch.Tensor | None) -> RowParams:
    penalised = [row for row, p in enumerate(settings) if p.penalised]
    penalties = None
    if penalised:
        mask = torch.zeros(len(penalised), VOCAB, dtype=torch.bool)
        counts = torch.zeros(len(penalised), VOCAB, dtype=torch.int32)
        for index, row in enumerate(penalised):
            mask[index, prompts[row]] = True
            for token in generated[row]:
                counts[index, token] += 1
        penalties = RowPenalties(
            rows=torch.tensor(penalised), prompt_mask=mask, output_counts=counts,
            repetition=torch.tensor([settings[r].repetition_penalty for r in penalised]),
            frequency=torch.tensor([settings[r].frequency_penalty for r in penalised]),
            presence=torch.tensor([settings[r].presence_penalty for r in penalised]),
        )
    pairs = [(row, token, bias) for row, p in enumerate(settings) for token, bias in p.logit_bias]
    bias = None
    if pairs:
        rows, tokens, values = zip(*pairs)
        bias = (torch.tensor(rows), torch.tensor(tokens), torch.tensor(values, dtype=torch.float32))
    random = [row for row, p in enumerate(settings) if not p.greedy]
    chosen = [settings[row] for row in random]
    top_ks = [p.top_k for p in chosen]
    return RowParams(
        temperature=torch.tensor([p.temperature for p in chosen], dtype=torch.float32),
        top_p=torch.tensor([p.top_p for p in chosen], dtype=torch.float32),
        top_k=torch.tensor(top_ks, dtype=torch.int64),
        min_p=torch.tensor([p.min_p for p in chosen], dtype=torch.float32),
        random_rows=torch.tensor(random, dtype=torch.int64),
        noise=None if not random or noise is None else noise[random],
        penalties=penalties, bias=bias, top_k_bound=max(top_ks) if top_ks and min(top_ks) > 0 else 0,
        any_top_p=any(p.top_p < 1 for p in chosen), any_min_p=any(p.min_p > 0 for p in chosen),
    )


CASES = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.7, logit_bias=((3, 2.5),)),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=-0.5),
    SamplingParams(temperature=2.0, top_p=0.5, logit_bias=((0, -100.0), (7, 3.0))),
]


@pytest.mark.parametrize("cases", [CASES, [case for case in CASES if case.top_k or case.greedy]],
                         ids=["sort", "topk"])
def test_each_row_draws_from_its_reference_distribution(cases):
    """Every case as one row of a batch, many draws each: tokens outside the reference support
    never appear, and frequencies match the reference within sampling error. ``topk``: every
    sampled row has a top_k, so candidates come from ``torch.topk`` instead of a sort."""
    generator = torch.Generator().manual_seed(0)
    draws, batch = 6000, 200
    logits = torch.randn(len(cases), VOCAB, generator=generator) * 2
    prompts = [[1, 4, 4, 9] for _ in cases]
    generated = [[4, 2, 2, 11] for _ in cases]
    references = [reference_probs(logits[row].tolist(), cases[row], prompts[row], generated[row])
                  for row in range(len(cases))]
    counts = torch.zeros(len(cases), VOCAB)
    for _ in range(draws // batch):
        # the rows repeated ``batch`` times: each repeat an independent draw
        noise = torch.empty(len(cases) * batch, VOCAB).exponential_(generator=generator)
        params = _row_params(cases * batch, prompts * batch, generated * batch, noise)
        assert bool(params.top_k_bound) == (cases is not CASES)
        ids, _ = sample_rows(logits.repeat(batch, 1), params)
        for row, token in enumerate(ids.tolist()):
            counts[row % len(cases), token] += 1
    for row, reference in enumerate(references):
        for token in range(VOCAB):
            seen = counts[row, token].item() / draws
            if reference[token] == 0.0:
                assert seen == 0.0, (row, cases[row], token, reference)
            else:
                assert abs(seen - reference[token]) < 4 * math.sqrt(reference[token] / draws) + 1e-3, (
                    row, cases[row], token, seen, reference[token])


def test_greedy_rows_take_the_penalised_argmax_and_ignore_the_noise():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(len(CASES), VOCAB, generator=generator)
    prompts, generated = [[2, 3] for _ in CASES], [[5, 5, 6] for _ in CASES]
    noise = torch.empty(len(CASES), VOCAB).exponential_(generator=generator)
    ids, _ = sample_rows(logits, _row_params(CASES, prompts, generated, noise))
    for row, params in enumerate(CASES):
        if params.greedy:
            reference = reference_probs(logits[row].tolist(), params, prompts[row], generated[row])
            assert ids[row].item() == reference.index(1.0)
    all_greedy = [SamplingParams()] * 3
    ids, _ = sample_rows(logits[:3], _row_params(all_greedy, prompts[:3], generated[:3], None))
    assert ids.tolist() == logits[:3].argmax(-1).tolist()


class _Registry:
    def __init__(self, params: dict[str, SamplingParams]) -> None:
        self.params = params

    def take(self, request_id: str) -> SamplingParams:
        return self.params.get(request_id, SamplingParams())


def _decode(sampler: BatchSampler, batches: list[list[str]], steps: int, logits_for) -> dict[str, list[int]]:
    """Run ``steps`` steps; each step samples every batch of ``batches`` (its own rows)."""
    tokens: dict[str, list[int]] = {}
    for step in range(steps):
        for batch in batches:
            logits = torch.stack([logits_for(request_id, step) for request_id in batch])
            ids, _ = sampler.sample(batch, lambda request_id: [1, 2, 3], logits)
            for request_id, token in zip(batch, ids.tolist()):
                tokens.setdefault(request_id, []).append(token)
    return tokens


def _logits_for(request_id: str, step: int) -> torch.Tensor:
    # the same logits for the same (prompt, step), whatever the request id: only the seed matters
    prompt = request_id.split("#")[0]
    generator = torch.Generator().manual_seed(hash((prompt, step)) % 2**31)
    return torch.randn(VOCAB, generator=generator)


def test_a_seed_gives_the_same_tokens_whatever_the_batch():
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    params = {"p#alone": seeded, "p#crowd": seeded, "p#other-seed": SamplingParams(temperature=1.0, top_p=0.95, seed=7),
              "q#unseeded": SamplingParams(temperature=1.0), "r#greedy": SamplingParams(), "s#penalised":
              SamplingParams(temperature=0.9, frequency_penalty=1.0, seed=3)}
    alone = _decode(BatchSampler(_Registry(params).take, VOCAB, torch.device("cpu")), [["p#alone"]], 30, _logits_for)
    crowd = _decode(BatchSampler(_Registry(params).take, VOCAB, torch.device("cpu")),
                    [["q#unseeded", "r#greedy", "p#crowd", "s#penalised"], ["p#other-seed"]], 30, _logits_for)
    assert alone["p#alone"] == crowd["p#crowd"]
    assert crowd["p#other-seed"] != crowd["p#crowd"]


def test_penalty_counts_follow_the_sampled_tokens_and_are_released():
    params = {"a": SamplingParams(temperature=0.0, frequency_penalty=2.0), "b": SamplingParams()}
    sampler = BatchSampler(_Registry(params).take, VOCAB, torch.device("cpu"))
    logits = torch.full((VOCAB,), -10.0)
    logits[5], logits[6] = 1.0, 0.5  # greedy picks 5, then 6 (1 - 2 < 0.5), then 5 again (-1 > 0.5 - 2)
    tokens = []
    for _ in range(3):
        ids, _ = sampler.sample(["a", "b"], lambda request_id: [], torch.stack([logits, logits]))
        tokens.append(ids.tolist())
    assert [row[1] for row in tokens] == [5, 5, 5]  # b is not penalised
    assert [row[0] for row in tokens] == [5, 6, 5]
    assert sampler.tracked == 2
    sampler.release("a")
    sampler.release("b")
    assert sampler.tracked == 0


def test_repetition_penalty_reads_the_prompt():
    params = {"a": SamplingParams(temperature=0.0, repetition_penalty=4.0)}
    sampler = BatchSampler(_Registry(params).take, VOCAB, torch.device("cpu"))
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 8] = 2.0, 1.0
    ids, _ = sampler.sample(["a"], lambda request_id: [3], logits)  # 2 / 4 < 1: 8 wins
    assert ids.tolist() == [8]


def test_checkpoint_defaults():
    from transformers import GenerationConfig

    assert checkpoint_defaults(GenerationConfig(do_sample=False, temperature=0.7)).greedy
    sampled = checkpoint_defaults(GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20,
                                                   repetition_penalty=1.1))
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.repetition_penalty) == (0.6, 0.95, 20, 1.1)
