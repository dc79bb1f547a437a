"""Per-request limits of ``kvplug serve``, applied before a request reaches the batching worker.

A request whose prompt cannot fit is refused with a 400 naming the limit (vLLM's wording); one
whose prompt fits but whose ``max_tokens`` would run past the limit has ``max_new_tokens``
lowered so that generation stops there with ``finish_reason: "length"``. kvplug's cache refuses a
prompt longer than ``max_seq_len`` and a request growing past it by raising in the worker thread,
which would stop transformers' generation loop for every request: nothing that could trip it may
be submitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvplug.interface import InvalidArgumentError


class RequestRefused(InvalidArgumentError):
    """A request the server answers with an HTTP error instead of running it.

    Attributes:
        status: the HTTP status code (400 bad request, 404 unknown model, 413 too large, 503 ...).
        param: the request field at fault, or ``None``.
        kind: the OpenAI error ``type`` (``invalid_request_error``, ``server_error`` ...).
    """

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def to_json(self) -> dict:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class RequestLimits:
    """What one request may hold.

    Attributes:
        max_context_len: prompt plus generated tokens of one request: the cache's ``max_seq_len``
            (kvplug) or the model's context, capped by what the KV pool can hold at all.
        source: the flag or setting that set it, named in refusals (``--max-seq-len 1024``).
    """

    max_context_len: int
    source: str

    def __post_init__(self) -> None:
        value = self.max_context_len
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise InvalidArgumentError(f"max_context_len must be an int >= 2, got {self.max_context_len!r}")

    def admit(self, prompt_len: int, requested_new_tokens: int | None) -> int:
        """The ``max_new_tokens`` to submit for a prompt of ``prompt_len`` tokens.

        Raises ``RequestRefused`` (400) when the prompt is empty or leaves no room for one
        generated token; otherwise returns ``requested_new_tokens`` lowered to the room left
        (``None`` means "as many as fit").
        """
        limit = self.max_context_len
        if prompt_len < 1:
            raise RequestRefused("the prompt is empty: it must hold at least one token", param="messages")
        if prompt_len >= limit:
            raise RequestRefused(
                f"This model's maximum context length is {limit} tokens. However, you requested {prompt_len} tokens "
                f"in the messages, which leaves no room for the completion (the limit is set by {self.source}). "
                "Please reduce the length of the messages.",
                param="messages",
            )
        room = limit - prompt_len
        if requested_new_tokens is None or requested_new_tokens > room:
            return room
        return requested_new_tokens

    def check_text_size(self, text_bytes: int, bytes_per_token: int) -> None:
        """Refuse (400) before tokenising a prompt whose text cannot fit: no token covers more than
        ``bytes_per_token`` bytes, so ``text_bytes`` bytes are at least ``text_bytes / bytes_per_token``
        tokens (halved again for tokenizers whose normalisers shrink text)."""
        fewest_tokens = text_bytes // (2 * max(bytes_per_token, 1))
        if fewest_tokens >= self.max_context_len:
            raise RequestRefused(
                f"This model's maximum context length is {self.max_context_len} tokens. However, the messages hold "
                f"at least {text_bytes:,} bytes of text, at least {fewest_tokens:,} tokens, which leaves no room for the "
                f"completion (the limit is set by {self.source}). Please reduce the length of the messages.",
                param="messages",
            )

    def apply(self, prompt_ids: Any, generation_config: Any) -> None:
        """``admit`` for a tokenized prompt (a list, or a ``[1, n]`` tensor), writing the result
        into the request's own ``GenerationConfig`` (its handler reads ``max_new_tokens`` back to
        report ``finish_reason: "length"``)."""
        prompt_len = len(prompt_ids) if isinstance(prompt_ids, list) else int(prompt_ids.shape[-1])
        generation_config.max_new_tokens = self.admit(prompt_len, generation_config.max_new_tokens)
