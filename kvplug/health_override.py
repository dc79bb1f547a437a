"""A host's health answer replaced by kvplug's when kvplug has something to report (issue 32).

The SGLang and vLLM adapters both put an ASGI middleware on the host's ``/health``: the host answers
first (its 503 for a dead engine stands), and only a 200 may become kvplug's answer. This is that
shared step; each adapter decides where the answer comes from."""

from __future__ import annotations

import json
from typing import Awaitable, Callable, Optional

Answer = Optional[tuple[int, dict]]


async def answer_over_ok(app: Callable[..., Awaitable[None]], scope: dict, receive: Callable, send: Callable,
                         answer: Callable[[], Awaitable[Answer]]) -> None:
    """Run ``app`` with its response held; when it answered 200 and ``await answer()`` gives
    ``(status, body)``, send ``body`` as JSON with that status instead, else the held response."""
    held: list[dict] = []

    async def hold(message: dict) -> None:
        held.append(message)

    await app(scope, receive, hold)
    status = next((m["status"] for m in held if m["type"] == "http.response.start"), None)
    replacement = await answer() if status == 200 else None
    if replacement is None:
        for message in held:
            await send(message)
        return
    code, body = replacement
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
