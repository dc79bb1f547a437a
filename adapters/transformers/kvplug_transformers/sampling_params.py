"""``SamplingParams``: one request's sampling, as vLLM serves the OpenAI fields (a value type of the
integration: the HTTP layer's ``sampling_fields`` builds it, the worker's ``sampler`` applies it).

A request's ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``repetition_penalty``,
``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` override the checkpoint's defaults
(``generation_config.json``: its ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
``repetition_penalty``; a checkpoint with ``do_sample`` false decodes greedily unless a request
asks for a temperature). ``temperature`` 0 is greedy whatever the checkpoint says. Values out of
range are refused by ``sampling_fields`` (the HTTP layer); ``kvplug_transformers.sampler`` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy decoding


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling (vLLM's meaning for each field).

    Attributes:
        temperature: logits are divided by it; below ``GREEDY_BELOW``: greedy (argmax).
        top_p: keep the fewest most likely tokens whose probabilities sum to at least ``top_p``; 1: off.
        top_k: keep the ``top_k`` most likely tokens; 0: off.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's; 0: off.
        seed: the request's own random stream (same seed, same prompt: same tokens); ``None``: the
            server's stream.
        repetition_penalty: logits of tokens in the prompt or the output so far are divided by it
            (positive) or multiplied by it (negative); 1: off.
        frequency_penalty: subtracted from a token's logit once per time it was generated; 0: off.
        presence_penalty: subtracted from a token's logit if it was generated at all; 0: off.
        logit_bias: ``(token id, bias)`` pairs added to the logits before anything else.
        stop: strings that end the generation where they appear in the output text (the text
            returned stops before the first of them; ``finish_reason`` is ``"stop"``).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        """Whether the output so far (or the prompt) changes the logits."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def describe(self) -> str:
        if self.greedy:
            shown = ["greedy"]
        else:
            shown = [f"temperature {self.temperature:g}", f"top_p {self.top_p:g}"]
            shown += [f"top_k {self.top_k}"] if self.top_k else []
            shown += [f"min_p {self.min_p:g}"] if self.min_p else []
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
            value, off = getattr(self, name), 1.0 if name == "repetition_penalty" else 0.0
            if value != off:
                shown.append(f"{name} {value:g}")
        return ", ".join(shown)


def checkpoint_defaults(generation_config: Any) -> SamplingParams:
    """The sampling a request gets for the fields it leaves out: the checkpoint's
    ``generation_config`` (greedy when ``do_sample`` is false or its temperature is 0)."""

    def number(name: str, default: float) -> float:
        value = getattr(generation_config, name, None)
        return default if value is None else float(value)

    temperature = number("temperature", 1.0)
    if not getattr(generation_config, "do_sample", False):
        temperature = 0.0
    top_k = getattr(generation_config, "top_k", None)
    return SamplingParams(
        temperature=temperature, top_p=number("top_p", 1.0), top_k=int(top_k) if top_k and top_k > 0 else 0,
        min_p=number("min_p", 0.0), repetition_penalty=number("repetition_penalty", 1.0),
    )
