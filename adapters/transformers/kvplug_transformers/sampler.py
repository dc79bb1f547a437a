"""kvplug's batched sampler: every row of a step's logits sampled with its own request's settings.

transformers' continuous batching samples a whole batch one way (``ModelRunner.do_sample``, the
processors of the config the worker started with). With ``kvplug serve`` the worker starts greedy
with no processors, so ``ModelRunner._sample`` receives the raw float logits, and kvplug's
replacement of it (``installation``) hands them here with the step's request ids in row order.

``sample_rows`` is one vectorised pass over ``[B, V]`` logits with per-row parameter tensors, in
vLLM's order: logit bias, penalties (repetition over prompt and output, frequency and presence
over the output), then greedy rows take the argmax, the others are divided by their temperature,
masked by min-p, top-k and top-p (``torch.topk`` of the largest ``top_k`` when every sampled row
has one, else a sort), and sampled as ``argmax(probs / noise)`` with exponential noise, one draw
per vocabulary entry (the Gumbel-max trick), so each row draws from its own random stream.
``BatchSampler`` keeps what lasts across steps: each request's ``torch.Generator`` (``seed``: the
same seed gives the same tokens whatever else is in the batch) and, for penalised requests,
device-side counts of the tokens generated so far (updated from the sampled ids on the device: no
host sync, so transformers' async batching still prepares step N+1 while step N runs). Decode
steps replayed from kvplug's CUDA graphs are sampled here too, after the replay, on the graph's
logits output: sampling is not part of the captured graph.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvplug.interface import InvalidArgumentError

from kvplug_transformers.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowPenalties:
    """The penalised rows of a step (``P`` of the ``B`` rows).

    Attributes:
        rows: shape ``[P]``, int64, device: their indices among the step's rows.
        repetition, frequency, presence: shape ``[P]``, float32, device.
        prompt_mask: shape ``[P, V]``, bool, device: the token occurs in the request's prompt.
        output_counts: shape ``[P, V]``, int32, device: times the request generated the token.
    """

    rows: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    prompt_mask: torch.Tensor
    output_counts: torch.Tensor


@dataclass(frozen=True)
class RowParams:
    """Per-row settings of one step's ``B`` rows, ``R`` of which sample at random (the others are
    greedy); tensors on the logits' device.

    Attributes:
        temperature: shape ``[R]``, float32, of the random rows.
        top_p: shape ``[R]``, float32 (1: off).
        top_k: shape ``[R]``, int64 (0: off).
        min_p: shape ``[R]``, float32 (0: off).
        random_rows: shape ``[R]``, int64: their indices among the ``B`` rows.
        noise: shape ``[R, V]``, float32, exponential(1) draws, one row per random row (a seeded
            request's from its own generator), or ``None`` when ``R`` is 0.
        penalties: the penalised rows, or ``None``.
        bias: ``(rows [N] int64, tokens [N] int64, values [N] float32)`` added to the logits, or ``None``.
        top_k_bound: the largest ``top_k`` when every random row has one (the candidates are then
            found with ``torch.topk`` of that size, not a sort of the vocabulary), else 0.
        any_top_p, any_min_p: host-side flags, so no step reads the device to decide what to skip.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    random_rows: torch.Tensor
    noise: torch.Tensor | None
    penalties: RowPenalties | None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    top_k_bound: int
    any_top_p: bool
    any_min_p: bool


def sample_rows(logits: torch.Tensor, params: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args:
        logits: shape ``[B, V]``, float32, device (not modified).
        params: the rows' settings.

    Returns:
        ``(ids, processed)``: ids shape ``[B]``, int64; ``processed`` shape ``[B, V]`` float32, the
        logits after bias and penalties (what a greedy row takes the argmax of).
    """
    scores = logits
    if params.bias is not None:
        rows, tokens, values = params.bias
        scores = scores.index_put((rows, tokens), values, accumulate=True)
    if params.penalties is not None:
        scores = _apply_penalties(scores, params.penalties)
    ids = scores.argmax(dim=-1)
    if params.noise is None:
        return ids, scores
    scaled = scores.index_select(0, params.random_rows) / params.temperature.unsqueeze(-1)  # [R, V]
    if params.any_min_p:
        probs = scaled.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * params.min_p.unsqueeze(-1)
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if params.top_k_bound:
        # every random row keeps at most top_k_bound tokens: rank only those candidates
        candidates, order = scaled.topk(min(params.top_k_bound, scaled.shape[-1]), dim=-1)  # [R, K]
    elif params.any_top_p:
        candidates, order = scaled.sort(dim=-1, descending=True)
    else:
        candidates, order = scaled, None
    if order is not None:
        candidates = _mask_ranks(candidates, params)
        noise = params.noise.gather(1, order)  # each token keeps its own draw, whatever the ranking
    else:
        noise = params.noise
    choice = (candidates.softmax(dim=-1) / noise).argmax(dim=-1, keepdim=True)
    sampled = choice if order is None else order.gather(1, choice)
    return ids.index_copy(0, params.random_rows, sampled.squeeze(-1)), scores


def _apply_penalties(scores: torch.Tensor, penalties: RowPenalties) -> torch.Tensor:
    """vLLM's penalties on the penalised rows (a new tensor; the others' rows copied as they are)."""
    rows = scores.index_select(0, penalties.rows)  # [P, V]
    counts = penalties.output_counts
    generated = counts > 0
    repetition = penalties.repetition.unsqueeze(-1)
    seen = penalties.prompt_mask | generated
    rows = torch.where(seen, torch.where(rows > 0, rows / repetition, rows * repetition), rows)
    rows = rows - penalties.frequency.unsqueeze(-1) * counts.to(rows.dtype)
    rows = rows - penalties.presence.unsqueeze(-1) * generated.to(rows.dtype)
    return scores.index_copy(0, penalties.rows, rows)


def _mask_ranks(ranked: torch.Tensor, params: RowParams) -> torch.Tensor:
    """On logits ranked largest first (``[R, K]``): mask all but each row's ``top_k`` largest,
    then all but its top-p nucleus (the fewest largest whose probabilities sum to at least
    ``top_p``, after top-k)."""
    width = ranked.shape[-1]
    ranks = torch.arange(width, device=ranked.device).unsqueeze(0)
    keep = torch.where(params.top_k > 0, params.top_k, torch.full_like(params.top_k, width)).unsqueeze(-1)
    ranked = ranked.masked_fill(ranks >= keep, float("-inf"))
    if params.any_top_p:
        probs = ranked.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
        top_p = params.top_p.unsqueeze(-1)
        ranked = ranked.masked_fill((before >= top_p) & (top_p < 1.0), float("-inf"))
    return ranked


@dataclass(eq=False)
class _Request:
    params: SamplingParams
    generator: torch.Generator | None
    slot: int | None  # its row in the penalty tensors


class BatchSampler:
    """Samples the steps of one continuous-batching worker with per-request settings.

    Args:
        params_of: the settings of a request id (``RequestSampling.take``), asked once per request,
            at its first sampled step.
        vocab_size: ``V``, the logits' last dimension.
        device: where the logits are.
        forget: called with a released request's id (``RequestSampling.discard``: a request that
            ended before its first sampled step leaves no settings behind).
    """

    def __init__(self, params_of: Callable[[str], SamplingParams], vocab_size: int, device: torch.device,
                 forget: Callable[[str], None] | None = None) -> None:
        self._params_of = params_of
        self._forget = forget
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()  # release() may come from another thread than the worker's
        self._counts: torch.Tensor | None = None  # [slots, V] int32
        self._prompt_mask: torch.Tensor | None = None  # [slots, V] bool
        self._free_slots: list[int] = []

    def sample(self, request_ids: Sequence[str], prompt_of: Callable[[str], Sequence[int]],
               logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample the step's rows.

        Args:
            request_ids: the request of each row, in row order.
            prompt_of: a request's prompt ids (read once, for ``repetition_penalty``).
            logits: shape ``[B, V]``, float32, device, ``B == len(request_ids)``.

        Returns:
            ``(ids, processed)`` as ``sample_rows``; the penalised requests' counts include ``ids``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(request_ids) or logits.shape[1] != self.vocab_size:
            raise InvalidArgumentError(
                f"the sampler expected logits of shape [{len(request_ids)}, {self.vocab_size}] (one row per "
                f"sampling request of the step), got {list(logits.shape)}"
            )
        with self._lock:
            requests = [self._request(request_id, prompt_of) for request_id in request_ids]
            if all(r.params.greedy and r.slot is None and not r.params.logit_bias for r in requests):
                return logits.argmax(dim=-1), logits  # plain greedy: nothing to build
            params = self._row_params(requests, logits.dtype)
            ids, processed = sample_rows(logits, params)
            if params.penalties is not None:
                slots = self._to_device([r.slot for r in requests if r.slot is not None], torch.int64)
                ones = torch.ones(slots.shape[0], dtype=torch.int32, device=self.device)
                self._counts.index_put_((slots, ids.index_select(0, params.penalties.rows)), ones, accumulate=True)
        return ids, processed

    def release(self, request_id: str) -> None:
        """Forget a finished request (its generator, its penalty row)."""
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is not None and request.slot is not None:
                self._free_slots.append(request.slot)
        if self._forget is not None:
            self._forget(request_id)

    def release_all(self) -> None:
        with self._lock:
            for request_id in list(self._requests):
                request = self._requests.pop(request_id)
                if request.slot is not None:
                    self._free_slots.append(request.slot)

    def params(self, request_id: str) -> SamplingParams | None:
        """The settings of a request sampled at least once (``None`` otherwise)."""
        with self._lock:
            request = self._requests.get(request_id)
        return None if request is None else request.params

    @property
    def tracked(self) -> int:
        """Requests with state here (for tests: none is left once all finished)."""
        return len(self._requests)

    # ------------------------------------------------------------------ per-request state
    def _request(self, request_id: str, prompt_of: Callable[[str], Sequence[int]]) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            params = self._params_of(request_id)
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            slot = self._new_slot(prompt_of(request_id)) if params.penalised else None
            request = self._requests[request_id] = _Request(params, generator, slot)
        return request

    def _new_slot(self, prompt: Sequence[int]) -> int:
        if not self._free_slots:
            used = 0 if self._counts is None else self._counts.shape[0]
            grown = max(2 * used, 4)
            counts = torch.zeros(grown, self.vocab_size, dtype=torch.int32, device=self.device)
            mask = torch.zeros(grown, self.vocab_size, dtype=torch.bool, device=self.device)
            if used:
                counts[:used] = self._counts
                mask[:used] = self._prompt_mask
            self._counts, self._prompt_mask = counts, mask
            self._free_slots.extend(range(grown - 1, used - 1, -1))
        slot = self._free_slots.pop()
        self._counts[slot].zero_()
        self._prompt_mask[slot].zero_()
        if prompt:
            ids = self._to_device([token for token in prompt if 0 <= token < self.vocab_size], torch.int64)
            self._prompt_mask[slot, ids] = True
        return slot

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A small host list on the device without waiting for the stream (pinned, non-blocking
        copy on CUDA), so the host can run ahead of the step it samples."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _row_params(self, requests: list[_Request], dtype: torch.dtype) -> RowParams:
        vocab = self.vocab_size
        device = self.device
        settings = [request.params for request in requests]

        column = self._to_device

        random = [row for row, p in enumerate(settings) if not p.greedy]
        noise = None
        if random:
            noise = torch.empty(len(random), vocab, dtype=torch.float32, device=device).exponential_()
            for index, row in enumerate(random):
                generator = requests[row].generator
                if generator is not None:
                    noise[index].exponential_(generator=generator)  # the request's own stream, one draw a step
        penalties = None
        penalised = [row for row, request in enumerate(requests) if request.slot is not None]
        if penalised:
            slots = column([requests[row].slot for row in penalised], torch.int64)
            penalties = RowPenalties(
                rows=column(penalised, torch.int64),
                repetition=column([settings[row].repetition_penalty for row in penalised], torch.float32),
                frequency=column([settings[row].frequency_penalty for row in penalised], torch.float32),
                presence=column([settings[row].presence_penalty for row in penalised], torch.float32),
                prompt_mask=self._prompt_mask.index_select(0, slots),
                output_counts=self._counts.index_select(0, slots),
            )
        bias = None
        pairs = [(row, token, value) for row, p in enumerate(settings) for token, value in p.logit_bias]
        if pairs:
            rows, tokens, values = zip(*pairs)
            bias = (column(list(rows), torch.int64), column(list(tokens), torch.int64),
                    column(list(values), dtype))
        chosen = [settings[row] for row in random]
        top_ks = [p.top_k for p in chosen]
        return RowParams(
            temperature=column([p.temperature for p in chosen], torch.float32),
            top_p=column([p.top_p for p in chosen], torch.float32),
            top_k=column(top_ks, torch.int64),
            min_p=column([p.min_p for p in chosen], torch.float32),
            random_rows=column(random, torch.int64), noise=noise, penalties=penalties, bias=bias,
            top_k_bound=max(top_ks) if top_ks and min(top_ks) > 0 else 0,
            any_top_p=any(p.top_p < 1.0 for p in chosen), any_min_p=any(p.min_p > 0.0 for p in chosen),
        )
