"""Reading a model's ``config.json`` for the CLI, bounded: a file the CLI reads must not hang it
(``/dev/zero``), overflow the stack (JSON nested 100k deep) or end in a traceback (not UTF-8).
Each of those is an ``InvalidArgumentError`` naming the file and what was expected."""

from __future__ import annotations

import json
import os
from typing import Any

from kvplug.interface import InvalidArgumentError

MAX_CONFIG_BYTES = 16 << 20  # model configs are kilobytes; anything past this is not one
MAX_CONFIG_DEPTH = 64


def config_path(path: str | os.PathLike) -> str:
    """``config.json`` of a model directory, or the file itself."""
    return os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` (of a model directory, or the file) as a mapping."""
    file = config_path(path)
    if os.path.exists(file) and not os.path.isfile(file):  # a device or a pipe would never end
        raise InvalidArgumentError(f"model config {file!r} is not a regular file")
    try:
        with open(file, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise InvalidArgumentError(f"cannot read model config {file!r}: {error.strerror or error}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise InvalidArgumentError(f"model config {file!r} is over {MAX_CONFIG_BYTES:,} bytes: not a model config")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidArgumentError(f"model config {file!r} is not UTF-8 text: {error}") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise InvalidArgumentError(f"model config {file!r} nests deeper than {MAX_CONFIG_DEPTH} levels") from None
    except ValueError as error:
        raise InvalidArgumentError(f"model config {file!r} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"model config {file!r} must hold a JSON object, got {type(data).__name__}")
    if _depth(data) > MAX_CONFIG_DEPTH:
        raise InvalidArgumentError(f"model config {file!r} nests deeper than {MAX_CONFIG_DEPTH} levels")
    return data


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_CONFIG_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest
