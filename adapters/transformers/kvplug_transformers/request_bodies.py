"""Checks of OpenAI request bodies before transformers' handlers see them.

transformers' handlers index the body directly (``body["messages"]``, ``int(body["max_tokens"])``),
so a missing field or a wrong type becomes a 500 with a traceback, and some parameters they cannot
honour (``n``, ``logprobs`` ...) are dropped with a warning. Here every field the handlers read is
checked and a bad or unsupported one is refused with a 400 naming the field, what was expected and
what was given. Checks may normalise the body in place (``max_completion_tokens`` becomes
``max_tokens``; the Responses API's ``stream`` defaults to false, as OpenAI's does).
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from kvplug_transformers.request_json import MAX_DEPTH, check_tree
from kvplug_transformers.request_limits import RequestRefused

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
TEXT_PART_TYPES = ("text", "input_text", "output_text")
# chat_template_kwargs a request may set, with the values each takes: variables chat templates
# read. Everything else (the call's own arguments: tokenize, return_tensors, tools ...) is refused
TEMPLATE_KWARGS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "enable_thinking": (lambda v: isinstance(v, bool), "true or false"),
    "thinking": (lambda v: isinstance(v, bool), "true or false"),
    "reasoning_effort": (lambda v: v in ("low", "medium", "high"), "'low', 'medium' or 'high'"),
    "date_string": (lambda v: isinstance(v, str) and len(v) <= 64, "a string of at most 64 characters"),
    "documents": (lambda v: isinstance(v, list) and all(isinstance(d, dict) for d in v), "a list of objects"),
}
REQUEST_TEMPLATE_KEY = "chat_template"  # a client's own Jinja template: only with --trust-request-chat-template
# GenerationConfig fields transformers' continuous batching applies per request (the sampling ones
# are compared with the server's by ServerSampling); any other field would be silently ignored
GENERATION_CONFIG_FIELDS = frozenset({
    "max_new_tokens", "eos_token_id", "pad_token_id", "bos_token_id", "do_sample", "temperature", "top_p", "top_k",
    "repetition_penalty", "sequence_bias", "stop_strings", "num_beams", "num_return_sequences", "use_cache",
})


def check_chat_completion(body: dict, *, trust_request_chat_template: bool = False) -> None:
    """``POST /v1/chat/completions``; a client's own ``chat_template`` only when trusted."""
    _check_common(body, "max_tokens")
    _refuse_unsupported_chat_parameters(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestRefused(
            f"'messages' must be a non-empty list of messages, got {_describe(messages)}", param="messages"
        )
    for index, message in enumerate(messages):
        _check_message(message, f"messages[{index}]")
    _expect(body, "tools", lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v), "a list of objects")
    _check_template_kwargs(body, trust_request_chat_template)
    _expect(body, "logit_bias", _is_logit_bias, "an object mapping token ids to numbers in [-100, 100]")
    _expect_number(body, "frequency_penalty", -2.0, 2.0)
    if body.get("logit_bias"):
        body["logit_bias"] = {key: float(bias) for key, bias in body["logit_bias"].items()}  # transformers wants floats


MAX_PROMPTS = 1024  # prompts one /v1/completions request may hold (each is a request of the batch)


def check_completion(body: dict, *, trust_request_chat_template: bool = False) -> None:
    """``POST /v1/completions`` (a raw text prompt, no chat template: the flag plays no part)."""
    _check_common(body, "max_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = body["prompt"] = prompt[0]  # a list of one prompt (text or token ids), as batch clients send
    prompts = multiple_prompts(body)
    if prompts is not None:  # several prompts: one choice each (multi_prompt answers them)
        if len(prompts) > MAX_PROMPTS:
            raise RequestRefused(f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request",
                                 param="prompt")
        for index, one in enumerate(prompts):
            _check_one_prompt(one, f"'prompt[{index}]'")
    else:
        _check_one_prompt(prompt, "'prompt'")
    _expect(body, "suffix", lambda v: isinstance(v, str), "a string")
    _refuse_if(body, "n", lambda v: not (_is_int(v) and v == 1), "n must be 1: this server returns one choice per prompt")
    _refuse_if(body, "best_of", lambda v: not (_is_int(v) and v == 1), "best_of must be 1: this server returns one choice per request")
    _refuse_if(body, "logprobs", lambda v: v not in (0, False), "logprobs are not supported by this server")
    _refuse_if(body, "echo", bool, "echo is not supported by this server")
    _expect_number(body, "presence_penalty", -2.0, 2.0)
    _expect_number(body, "frequency_penalty", -2.0, 2.0)


def multiple_prompts(body: dict) -> list | None:
    """The prompts of a checked ``/v1/completions`` body holding several (a list of strings, or a
    list of token-id lists), else ``None`` (one prompt: text, or one list of token ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(one, (str, list)) for one in prompt):
        return prompt
    return None


def _check_one_prompt(prompt: Any, name: str) -> None:
    is_ids = isinstance(prompt, list) and bool(prompt) and all(_is_int(t) for t in prompt)
    if not is_ids and (not isinstance(prompt, str) or not prompt):
        raise RequestRefused(
            f"{name} must be a non-empty string, a non-empty list of token ids, or a list of them, "
            f"got {_describe(prompt)}",
            param="prompt",
        )


def check_response(body: dict, *, trust_request_chat_template: bool = False) -> None:
    """``POST /v1/responses``; a client's own ``chat_template`` only when trusted."""
    _check_common(body, "max_output_tokens")
    body.setdefault("stream", False)  # OpenAI's default; transformers' handler would stream instead
    _refuse_if(
        body, "previous_response_id", bool, "previous_response_id is not supported: this server stores no responses"
    )
    _refuse_if(body, "background", bool, "background responses are not supported by this server")
    _refuse_if(body, "top_logprobs", lambda v: v != 0, "top_logprobs are not supported by this server")
    _expect(body, "instructions", lambda v: isinstance(v, str), "a string")
    _expect(body, "tools", lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v), "a list of objects")
    _check_template_kwargs(body, trust_request_chat_template)
    _refuse_if(body, "n", lambda v: not (_is_int(v) and v == 1), "n must be 1: this server returns one choice per request")
    _refuse_if(
        body, "tool_choice", lambda v: v not in ("auto", "none"),
        "tool_choice must be 'auto' or 'none' (forcing a tool is not supported)",
    )
    _refuse_if(body, "conversation", lambda v: True, "conversation is not supported: this server stores no conversations")
    _refuse_if(body, "prompt", lambda v: True, "prompt templates are not supported by this server")
    _refuse_if(
        body, "text", lambda v: not (isinstance(v, dict) and v.get("format", {"type": "text"}) == {"type": "text"}
                                     and set(v) <= {"format", "verbosity"}),
        "text.format other than {'type': 'text'} is not supported (no structured output)",
    )
    data = body.get("input")
    if isinstance(data, str):
        if not data:
            raise RequestRefused("'input' must not be empty", param="input")
        return
    if not isinstance(data, list) or not data:
        raise RequestRefused(f"'input' must be a non-empty string or list, got {_describe(data)}", param="input")
    if all(isinstance(item, dict) and "role" not in item and item.get("type") in TEXT_PART_TYPES for item in data):
        for index, part in enumerate(data):
            _check_content_part(part, f"input[{index}]")
        return
    for index, item in enumerate(data):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise RequestRefused(f"'{where}' must be an object, got {_describe(item)}", param="input")
        if "role" in item:
            _check_message(item, where)
        elif item.get("type") in ("function_call", "function_call_output"):
            keys = ("call_id", "name", "arguments") if item["type"] == "function_call" else ("call_id", "output")
            for key in keys:
                if not isinstance(item.get(key), str):
                    raise RequestRefused(
                        f"'{where}.{key}' must be a string, got {_describe(item.get(key))}", param="input"
                    )
            if item["type"] == "function_call":
                check_tool_arguments(item["arguments"], f"{where}.arguments", "input")
        elif item.get("type") == "reasoning":
            continue
        else:
            raise RequestRefused(
                f"'{where}' must be a message, function_call, function_call_output or reasoning item, "
                f"got type {item.get('type')!r}",
                param="input",
            )


# ---------------------------------------------------------------------------- shared checks
def check_tool_arguments(arguments: Any, where: str, param: str) -> None:
    """A tool call's arguments: a JSON object, or a string holding one (chat templates parse it)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as error:
            raise RequestRefused(
                f"'{where}' must be a JSON object (as a string), got {_describe(arguments)}: "
                f"{type(error).__name__}: {str(error)[:100]}",
                param=param,
            ) from error
    if not isinstance(arguments, dict):
        raise RequestRefused(f"'{where}' must be a JSON object, got {_describe(arguments)}", param=param)
    try:
        check_tree(arguments, MAX_DEPTH)
    except RequestRefused as error:
        raise RequestRefused(f"'{where}': {error}", param=param) from None


def _check_template_kwargs(body: dict, trusted: bool) -> None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise RequestRefused(
            f"'chat_template_kwargs' must be an object, got {_describe(kwargs)}", param="chat_template_kwargs"
        )
    for key, value in kwargs.items():
        if key == REQUEST_TEMPLATE_KEY:
            if not trusted:
                raise RequestRefused(
                    "'chat_template_kwargs.chat_template' (a client's own chat template) is refused: the server "
                    "renders the model's template only (start it with --trust-request-chat-template to allow it)",
                    param="chat_template_kwargs",
                )
            if not isinstance(value, str):
                raise RequestRefused(
                    f"'chat_template_kwargs.chat_template' must be a string, got {_describe(value)}",
                    param="chat_template_kwargs",
                )
            continue
        rule = TEMPLATE_KWARGS.get(key)
        if rule is None:
            raise RequestRefused(
                f"'chat_template_kwargs.{key}' is not allowed; a request may set {sorted(TEMPLATE_KWARGS)}",
                param="chat_template_kwargs",
            )
        valid, expected = rule
        if not valid(value):
            raise RequestRefused(
                f"'chat_template_kwargs.{key}' must be {expected}, got {_describe(value)}", param="chat_template_kwargs"
            )


def _check_common(body: dict, max_tokens_field: str) -> None:
    _expect(body, "model", lambda v: isinstance(v, str), "a string")
    _expect(body, "stream", lambda v: isinstance(v, bool), "true or false")
    if body.get("max_completion_tokens") is not None and max_tokens_field == "max_tokens":
        given = body.pop("max_completion_tokens")
        if body.get("max_tokens") is not None and body["max_tokens"] != given:
            raise RequestRefused(
                f"max_tokens={body['max_tokens']!r} and max_completion_tokens={given!r} disagree: give one of them",
                param="max_completion_tokens",
            )
        body["max_tokens"] = given
    value = body.get(max_tokens_field)
    if value is not None and not (_is_int(value) and value >= 1):
        raise RequestRefused(
            f"'{max_tokens_field}' must be an integer >= 1 (or omitted: as many as fit), got {value!r}",
            param=max_tokens_field,
        )
    _expect_number(body, "temperature", 0.0, 2.0)
    top_p = body.get("top_p")
    if top_p is not None and not (_is_number(top_p) and 0.0 < top_p <= 1.0):
        raise RequestRefused(f"'top_p' must be a number in (0, 1], got {top_p!r}", param="top_p")
    _expect(body, "seed", lambda v: _is_int(v) and 0 <= v < 2**63, "an integer in [0, 2**63)")
    _expect(
        body, "stop", lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
        "a string or a list of strings",
    )
    config = body.get("generation_config")
    if config is not None:
        _check_generation_config(config)


def _check_generation_config(config: Any) -> None:
    from transformers import GenerationConfig

    try:
        parsed = json.loads(config) if isinstance(config, str) else None
    except (ValueError, RecursionError) as error:
        parsed, why = None, f"{type(error).__name__}: {error}"
    else:
        why = "not a JSON object"
    if not isinstance(parsed, dict):
        raise RequestRefused(
            f"'generation_config' must be a JSON object of transformers GenerationConfig fields, given as a string: "
            f"{why}",
            param="generation_config",
        )
    ignored = sorted(set(parsed) - GENERATION_CONFIG_FIELDS)
    if ignored:
        raise RequestRefused(
            f"'generation_config' fields {ignored} are not applied per request by transformers' continuous batching; "
            f"this server takes only {sorted(GENERATION_CONFIG_FIELDS)}",
            param="generation_config",
        )
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = parsed.get(name)
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not ids or not all(_is_int(i) and 0 <= i < 2**31 for i in ids):
            raise RequestRefused(
                f"'generation_config.{name}' must be a token id (an integer >= 0) or a non-empty list of them, "
                f"got {_describe(value)}",
                param="generation_config",
            )
    value = parsed.get("max_new_tokens")
    if value is not None and not (_is_int(value) and value >= 1):
        raise RequestRefused(
            f"'generation_config.max_new_tokens' must be an integer >= 1, got {_describe(value)}",
            param="generation_config",
        )
    try:
        GenerationConfig(**parsed).validate()
    except Exception as error:  # unknown or inconsistent generation options
        raise RequestRefused(
            f"'generation_config' must be a JSON object of transformers GenerationConfig fields, given as a string: "
            f"{type(error).__name__}: {error}",
            param="generation_config",
        ) from error


def _refuse_unsupported_chat_parameters(body: dict) -> None:
    _refuse_if(body, "n", lambda v: not (_is_int(v) and v == 1), "n must be 1: this server returns one choice per request")
    _refuse_if(body, "logprobs", bool, "logprobs are not supported by this server")
    _refuse_if(body, "top_logprobs", lambda v: v != 0, "top_logprobs are not supported by this server")
    _expect_number(body, "presence_penalty", -2.0, 2.0)
    _refuse_if(
        body, "response_format", lambda v: not (isinstance(v, dict) and v.get("type") == "text"),
        "response_format other than {'type': 'text'} is not supported (no structured output)",
    )
    _refuse_if(body, "audio", bool, "audio output is not supported by this text model")
    _refuse_if(body, "modalities", lambda v: v != ["text"], "only the 'text' modality is supported")
    _refuse_if(body, "prediction", bool, "predicted outputs are not supported by this server")
    _refuse_if(body, "functions", bool, "'functions' is deprecated and not supported: use 'tools'")
    _refuse_if(body, "function_call", bool, "'function_call' is deprecated and not supported: use 'tools'")
    _refuse_if(
        body, "tool_choice", lambda v: v not in ("auto", "none"),
        "tool_choice must be 'auto' or 'none' (forcing a tool is not supported)",
    )


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise RequestRefused(
            f"'{where}' must be an object with 'role' and 'content', got {_describe(message)}", param=where
        )
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise RequestRefused(f"'{where}.role' must be one of {list(CHAT_ROLES)}, got {role!r}", param=where)
    if role == "developer":
        message["role"] = "system"  # OpenAI's newer name for it; chat templates know 'system'
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise RequestRefused(f"'{where}.tool_calls' must be a list on an assistant message", param=where)
        for index, call in enumerate(tool_calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not isinstance(
                function.get("arguments"), (str, dict)
            ):
                raise RequestRefused(
                    f"'{where}.tool_calls' entries must be {{'function': {{'name': str, 'arguments': str}}}}, "
                    f"got {_describe(call)}",
                    param=where,
                )
            check_tool_arguments(function["arguments"], f"{where}.tool_calls[{index}].function.arguments", where)
        return
    content = message.get("content")
    if isinstance(content, str):
        return
    if content is None and role == "assistant":
        return
    if not isinstance(content, list):
        raise RequestRefused(
            f"'{where}.content' must be a string or a list of text parts, got {_describe(content)}", param=where
        )
    for index, part in enumerate(content):
        _check_content_part(part, f"{where}.content[{index}]")


def _check_content_part(part: Any, where: str) -> None:
    if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
        kind = part.get("type") if isinstance(part, dict) else _describe(part)
        raise RequestRefused(
            f"'{where}' must be a text part {{'type': 'text', 'text': ...}}; this server serves a text model, "
            f"got {kind!r}",
            param=where,
        )
    if not isinstance(part.get("text"), str):
        raise RequestRefused(f"'{where}.text' must be a string, got {_describe(part.get('text'))}", param=where)


def _expect(body: dict, name: str, valid: Callable[[Any], bool], expected: str) -> None:
    value = body.get(name)
    if value is not None and not valid(value):
        raise RequestRefused(f"'{name}' must be {expected}, got {_describe(value)}", param=name)


def _expect_number(body: dict, name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is not None and not (_is_number(value) and low <= value <= high):
        raise RequestRefused(f"'{name}' must be a number in [{low:g}, {high:g}], got {value!r}", param=name)


def _refuse_if(body: dict, name: str, unsupported: Callable[[Any], bool], message: str) -> None:
    value = body.get(name)
    if value is not None and unsupported(value):
        raise RequestRefused(f"{message} (got {name}={value!r})", param=name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_logit_bias(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    for key, bias in value.items():
        if not (isinstance(key, str) and key.lstrip("-").isdigit() and _is_number(bias) and -100 <= bias <= 100):
            return False
    return True


def _describe(value: Any) -> str:
    """A short description of a bad value: its type, and the value itself when it is small."""
    text = repr(value)
    if value is None:
        return "nothing"
    if len(text) > 60:
        return f"a {type(value).__name__} ({text[:40]}...)"
    return f"{text} ({type(value).__name__})"
