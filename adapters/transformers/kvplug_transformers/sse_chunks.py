"""Streamed chat-completion chunks without pydantic: the same bytes as transformers' builder.

transformers' ``ChatCompletionHandler._build_chunk_sse`` validates a ``ChoiceDelta`` and builds a
``ChatCompletionChunk`` (pydantic) for every streamed token, then dumps it to JSON: most of the
HTTP process's CPU per streamed token. ``ChatChunkBuilder`` writes the chunks a stream carries per
token (a content or a reasoning delta, and the first, role-only chunk) from a template, with the
JSON string escaping pydantic's serializer uses; any other chunk (tool calls, the last chunk
with its finish reason and usage) goes to transformers' own builder. A test compares the two over
many inputs; ``compat.INTERNALS`` fingerprints the builder's source.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

_ENCODE = json.JSONEncoder(ensure_ascii=False).encode  # pydantic's JSON: UTF-8, control characters escaped


class ChatChunkBuilder:
    """Stands in for one handler's ``_build_chunk_sse`` (same arguments, same result).

    Args:
        original: transformers' bound ``_build_chunk_sse``, called for every chunk not written here.
    """

    __slots__ = ("_original",)

    def __init__(self, original: Callable[..., str]) -> None:
        self._original = original

    def __call__(
        self,
        request_id: str = "",
        content: str | None = None,
        model: str | None = None,
        role: str | None = None,
        finish_reason: str | None = None,
        tool_calls: list | None = None,
        usage: Any = None,
        reasoning_content: str | None = None,
    ) -> str:
        delta = None
        if not (
            finish_reason is not None
            or tool_calls is not None
            or usage is not None
            or model is None
            or type(request_id) is not str
            or type(model) is not str
        ):
            if isinstance(content, str) and role is None and reasoning_content is None:
                delta = '"content":' + _ENCODE(content)
            elif isinstance(reasoning_content, str) and role is None and content is None:  # ReasoningText
                delta = '"reasoning_content":' + _ENCODE(reasoning_content)
            elif role == "assistant" and content is None and reasoning_content is None:  # the stream's first chunk
                delta = '"role":"assistant"'
        if delta is None:  # any other chunk: transformers' own builder
            return self._original(
                request_id,
                content=content,
                model=model,
                role=role,
                finish_reason=finish_reason,
                tool_calls=tool_calls,
                usage=usage,
                reasoning_content=reasoning_content,
            )
        return (
            'data: {"id":'
            + _ENCODE(request_id)
            + ',"choices":[{"delta":{'
            + delta
            + '},"index":0}],"created":'
            + str(int(time.time()))
            + ',"model":'
            + _ENCODE(model)
            + ',"object":"chat.completion.chunk","system_fingerprint":""}\n\n'
        )
