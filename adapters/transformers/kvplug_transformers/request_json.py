"""Parsing a generation request's JSON body, refusing what would fail later with a 500.

Python's ``json`` accepts lone UTF-16 surrogates (``"\\ud800"``), which no tokenizer or response
can encode, and nests as deep as the recursion limit allows, which templates and validators then
overflow. Here the body must be UTF-8 JSON whose top level is an object (422 otherwise, as
FastAPI answers), nested at most ``MAX_DEPTH`` deep, with every string encodable (400 naming
where).
"""

from __future__ import annotations

import json
from typing import Any

from kvplug_transformers.request_limits import RequestRefused

MAX_DEPTH = 32  # objects and lists inside one another; OpenAI bodies need fewer than 10


def parse_body(raw: bytes) -> dict:
    """The body as a dict; ``RequestRefused`` (422 / 400) when it is not one we can serve."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestRefused(f"the request body is not UTF-8: {error}", status=422) from error
    try:
        body = json.loads(text)
    except RecursionError as error:
        raise RequestRefused(f"the request body nests deeper than {MAX_DEPTH} levels", status=400) from error
    except ValueError as error:
        raise RequestRefused(f"the request body is not valid JSON: {error}", status=422) from error
    if not isinstance(body, dict):
        raise RequestRefused(f"the request body must be a JSON object, got a {type(body).__name__}", status=422)
    check_tree(body)
    return body


def check_tree(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse nesting past ``max_depth`` and strings that are not valid Unicode (lone surrogates)."""
    stack: list[tuple[Any, int, tuple]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, dict):
            items: Any = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            _check_string(node, path)
            continue
        if depth > max_depth:
            raise RequestRefused(
                f"the request body nests deeper than {max_depth} levels (at {_where(path)})", param=_param(path)
            )
        for key, child in items:
            if isinstance(key, str):
                _check_string(key, path)
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, (*path, key)))
            else:
                _check_string(child, (*path, key))


def _check_string(value: Any, path: tuple) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise RequestRefused(
                f"'{_where(path)}' holds a lone UTF-16 surrogate ({error.object[error.start:error.end]!r} at "
                f"character {error.start}), which is not valid Unicode text",
                param=_param(path),
            ) from error


def _where(path: tuple) -> str:
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text or "body"


def _param(path: tuple) -> str | None:
    return str(path[0]) if path else None
