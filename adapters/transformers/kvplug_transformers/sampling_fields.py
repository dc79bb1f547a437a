"""``request_params``: a request body's sampling fields, checked, as ``SamplingParams``.

The OpenAI fields (``temperature``, ``top_p``, ``seed``, ``frequency_penalty``,
``presence_penalty``, ``logit_bias``, ``stop``), vLLM's extras (``top_k``, ``min_p``,
``repetition_penalty``) and the sampling fields of transformers' ``generation_config`` JSON are
popped from the body (transformers' handler never sees them) and checked against vLLM's ranges: a
value out of range, or a ``generation_config`` field the sampler cannot apply, is a
``RequestRefused`` (400) naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

from kvplug_transformers.request_limits import RequestRefused
from kvplug_transformers.sampling_params import SamplingParams

# the request fields SamplingParams takes (popped from the body before transformers' handler sees it)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "logit_bias", "stop")
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# transformers' generation_config (a request's JSON string) fields read as that request's sampling
GENERATION_CONFIG_SAMPLING = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# generation_config fields kvplug's sampler does not apply, with the values that mean "off"
GENERATION_CONFIG_UNHONOURED = {"sequence_bias": (None, {}), "stop_strings": (None, [], ""), "num_beams": (None, 1),
                                "num_return_sequences": (None, 1)}


def request_params(body: dict, defaults: SamplingParams, vocab_size: int) -> SamplingParams:
    """The sampling ``body`` asks for over ``defaults``; pops every field it reads from ``body``
    (``SAMPLING_FIELDS``, and ``generation_config``'s sampling fields).

    Raises:
        RequestRefused: a field out of its range (400, naming the field).
    """
    params = _from_generation_config(body, defaults)
    given = {name: body.pop(name) for name in SAMPLING_FIELDS if name in body}
    given = {name: value for name, value in given.items() if value is not None}
    changes: dict[str, Any] = {}
    if "temperature" in given:
        changes["temperature"] = _number(given, "temperature", 0.0, 2.0)
    if "top_p" in given:
        value = _number(given, "top_p", 0.0, 1.0)
        if value <= 0.0:
            raise RequestRefused(f"'top_p' must be a number in (0, 1], got {value!r}", param="top_p")
        changes["top_p"] = value
    if "top_k" in given:
        value = given["top_k"]
        if not _is_int(value) or value < -1:
            raise RequestRefused(f"'top_k' must be an integer: -1 or 0 (off) or >= 1, got {value!r}", param="top_k")
        changes["top_k"] = 0 if value in (-1, 0) or value >= vocab_size else int(value)
    if "min_p" in given:
        changes["min_p"] = _number(given, "min_p", 0.0, 1.0)
    if "seed" in given:
        value = given["seed"]
        if not _is_int(value) or not 0 <= value < 2**63:
            raise RequestRefused(f"'seed' must be an integer in [0, 2**63), got {value!r}", param="seed")
        changes["seed"] = int(value)
    if "repetition_penalty" in given:
        value = _number(given, "repetition_penalty", 0.0, math.inf)
        if value <= 0.0:
            raise RequestRefused(f"'repetition_penalty' must be a number > 0 (1: off), got {value!r}",
                                 param="repetition_penalty")
        changes["repetition_penalty"] = value
    for name in ("frequency_penalty", "presence_penalty"):
        if name in given:
            changes[name] = _number(given, name, -2.0, 2.0)
    if "logit_bias" in given:
        changes["logit_bias"] = _logit_bias(given["logit_bias"], vocab_size)
    if "stop" in given:
        changes["stop"] = _stop(given["stop"])
    return replace(params, **changes)


def _from_generation_config(body: dict, defaults: SamplingParams) -> SamplingParams:
    """``generation_config``'s sampling fields (request_bodies checked the JSON), popped from it."""
    text = body.get("generation_config")
    if text is None:
        return defaults
    config = json.loads(text)
    for name, off in GENERATION_CONFIG_UNHONOURED.items():
        if config.get(name) not in off:
            raise RequestRefused(
                f"'generation_config.{name}' {config[name]!r} is not supported by this server; leave it out",
                param="generation_config",
            )
    found = {name: config.pop(name) for name in GENERATION_CONFIG_SAMPLING if name in config}
    body["generation_config"] = json.dumps(config)
    changes: dict[str, Any] = {}
    if found.get("temperature") is not None:
        changes["temperature"] = float(found["temperature"])
    elif found.get("do_sample") and defaults.greedy:
        changes["temperature"] = 1.0
    if found.get("do_sample") is False:
        changes["temperature"] = 0.0
    if found.get("top_p") is not None:
        changes["top_p"] = float(found["top_p"])
    if found.get("top_k") is not None:
        changes["top_k"] = max(int(found["top_k"]), 0)
    if found.get("min_p") is not None:
        changes["min_p"] = float(found["min_p"])
    if found.get("repetition_penalty") is not None:
        changes["repetition_penalty"] = float(found["repetition_penalty"])
    return replace(defaults, **changes)


def _logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, dict):
        raise RequestRefused(f"'logit_bias' must be an object mapping token ids to numbers, got {value!r}",
                             param="logit_bias")
    pairs = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab_size:
            raise RequestRefused(
                f"'logit_bias' keys must be token ids in [0, {vocab_size}) (this model's vocabulary), got {key!r}",
                param="logit_bias",
            )
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise RequestRefused(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}",
                                 param="logit_bias")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


def _stop(value: Any) -> tuple[str, ...]:
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(text, str) for text in strings):
        raise RequestRefused(f"'stop' must be a string or a list of strings, got {value!r}", param="stop")
    strings = [text for text in strings if text]
    if len(strings) > MAX_STOP_STRINGS or any(len(text) > MAX_STOP_CHARS for text in strings):
        raise RequestRefused(
            f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters", param="stop"
        )
    return tuple(dict.fromkeys(strings))


def _number(given: dict, name: str, low: float, high: float) -> float:
    value = given[name]
    if not _is_number(value) or not low <= value <= high:
        raise RequestRefused(f"'{name}' must be a number in [{low:g}, {high:g}], got {value!r}", param=name)
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
