"""ASGI guards in front of transformers' FastAPI app: API key, body size, requests in flight.

``InFlightRequests`` knows every generation request being answered (streaming ones until their
last byte), so the server can refuse new ones while it stops, wait for the running ones to finish,
and abort the rest with a clear error: a JSON error before the response has started, a final
``data: {"error": ...}`` event on a stream already running. Aborting cancels the request's task, so
transformers' handler cancels the generation in the batching worker as it does for a client that
disconnects.

Nothing here waits on a client that does not read: a stalled stream's connection is reset (its
queued output dropped) before its task is cancelled, an aborted request's last words are sent
within the stall timeout or not at all, and a cancelled task that does not end within
``ABORT_GRACE_S`` is left behind (logged) rather than holding its slot.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from kvplug_transformers.http_protocol import BACKLOG_WATCH_KEY, CONNECTION_ABORT_KEY, DEFAULT_STALL_TIMEOUT_S
from kvplug_transformers.request_limits import RequestRefused

logger = logging.getLogger("kvplug.serve")
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
DISCARD_LIMIT = 64 << 20  # bytes of a refused body read (and dropped) so that its sender sees the 413
ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]


async def send_refusal(send: Callable, refusal: RequestRefused, headers: list | None = None) -> None:
    """Answer with OpenAI's error body at ``refusal.status``."""
    body = json.dumps(refusal.to_json()).encode()
    await send({
        "type": "http.response.start",
        "status": refusal.status,
        "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])
        ],
    })
    await send({"type": "http.response.body", "body": body})


OPEN_PATHS = frozenset({"/health"})  # answered without the API key: load balancers probe it


class ApiKeyCheck:
    """``--api-key``: every route but ``/health`` needs ``Authorization: Bearer <key>``
    (``/docs``, ``/openapi.json``, ``/kvplug/stats`` included)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                refusal = RequestRefused(
                    "missing or wrong API key: send 'Authorization: Bearer <key>' with the key given to --api-key",
                    status=401, kind="authentication_error",
                )
                return await send_refusal(send, refusal, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class BodySizeLimit:
    """Refuses a request body over ``limit`` bytes with 413, before anything parses it.

    The body is read here (at most ``limit + 1`` bytes) and replayed to the app, so a body sent
    without ``Content-Length`` is bounded too."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._discard_body(receive, int(declared))
            return await send_refusal(send, self._refusal(int(declared)))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                chunks.clear()
                if message.get("more_body", False):
                    await self._discard_body(receive, None)
                return await send_refusal(send, self._refusal(size, at_least=True))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _discard_body(receive: Callable, declared: int | None) -> None:
        """Read and drop the rest of a refused body, up to ``DISCARD_LIMIT`` bytes: a client
        still sending when the server answers and closes sees a reset, not the 413."""
        if declared is not None and declared > DISCARD_LIMIT:
            return
        seen = 0
        while seen <= DISCARD_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    def _refusal(self, size: int, at_least: bool = False) -> RequestRefused:
        return RequestRefused(
            f"the request body is {'over ' if at_least else ''}{size:,} bytes; this server accepts at most "
            f"{self.limit:,} (--max-request-bytes)",
            status=413,
        )


@dataclass
class _Running:
    task: asyncio.Task | None = None
    started: bool = False
    streaming: bool = False
    finished: bool = False
    stalled: bool = False
    abort_reason: str | None = None
    aborted: asyncio.Event = field(default_factory=asyncio.Event)  # set with abort_reason
    abort_connection: Callable[[], None] | None = None  # resets its connection (GuardedH11Protocol)
    cancels: list = field(default_factory=list)  # callables that cancel its generation (generation_routes adds them)


ABORT_GRACE_S = 5.0  # how long an aborted request's task may take to end before its slot is released anyway
CANCEL_KEY = "kvplug.cancel"  # scope key: the running request's list of generation cancellers


@dataclass
class InFlightRequests:
    """The generation requests being answered, and whether new ones are accepted.

    A response the client does not read for ``stall_timeout`` s (its unsent output is held to
    the connection's send buffers), or whose full write buffer does not drain completely within
    ``stall_timeout`` s (a client that reads, but slower than the stream; ``GuardedH11Protocol``
    watches it), is aborted: its generation is cancelled, its row freed, and the connection closed. ``close``, ``abort_all`` and ``count`` may be called from any thread."""

    closed_reason: str | None = None
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S
    stalled_total: int = 0
    _running: dict[int, _Running] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loop: asyncio.AbstractEventLoop | None = None

    def middleware(self, app: ASGIApp) -> ASGIApp:
        async def tracked(scope: dict, receive: Callable, send: Callable) -> None:
            if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
                return await app(scope, receive, send)
            if self.closed_reason is not None:
                return await send_refusal(send, RequestRefused(self.closed_reason, status=503))
            await self._run(app, scope, receive, send)

        return tracked

    def count(self) -> int:
        with self._lock:
            return len(self._running)

    def close(self, reason: str) -> None:
        """Refuse every generation request from now on with 503 ``reason``."""
        if self.closed_reason is None:
            self.closed_reason = reason

    def abort_all(self, reason: str) -> int:
        """End every running request with ``reason`` (503, or an error event on a stream);
        returns how many were running."""
        with self._lock:
            running = list(self._running.values())
        loop = self._loop
        if loop is None or not running:
            return 0
        for entry in running:
            loop.call_soon_threadsafe(self._abort, entry, reason)
        return len(running)

    @staticmethod
    def _abort(entry: _Running, reason: str) -> None:
        if entry.task is not None and not entry.task.done() and entry.abort_reason is None:
            entry.abort_reason = reason
            entry.aborted.set()
            entry.task.cancel()

    def _stalled(self, entry: _Running, reason: str) -> None:
        """The client does not take its response: reset its connection first (so no send of the
        request, ours or the app's, can wait on it any more), then cancel the request."""
        if entry.stalled:
            return
        entry.stalled = True
        self.stalled_total += 1
        if entry.abort_connection is not None:
            entry.abort_connection()
        self._abort(entry, reason)

    async def _run(self, app: ASGIApp, scope: dict, receive: Callable, send: Callable) -> None:
        self._loop = asyncio.get_running_loop()
        entry = _Running(abort_connection=scope.get(CONNECTION_ABORT_KEY))

        async def watched_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                entry.started = True
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                entry.streaming = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                if entry.streaming:
                    message = {**message, "body": openai_stream_error(message.get("body", b""))}
                if not message.get("more_body", False):
                    entry.finished = True
            if entry.stalled:
                raise asyncio.CancelledError()  # its connection is reset: nothing more reaches it
            try:
                await send_within(send, message, self.stall_timeout)
            except asyncio.TimeoutError:
                self._stalled(entry, f"the client read nothing of its response for {self.stall_timeout:g} s")
                raise asyncio.CancelledError() from None

        watch_backlog = scope.get(BACKLOG_WATCH_KEY)
        if watch_backlog is not None:
            watch_backlog(lambda: self._stalled(entry, (
                f"the client did not keep up with its response: its unsent output did not drain within "
                f"{self.stall_timeout:g} s of filling the connection's buffers (--stream-stall-timeout)")))
        scope[CANCEL_KEY] = entry.cancels
        entry.task = asyncio.ensure_future(app(scope, receive, watched_send))
        with self._lock:
            self._running[id(entry)] = entry
        try:
            await self._wait(entry)
        except asyncio.CancelledError:
            if entry.abort_reason is None:
                raise  # cancelled from outside (the server is going away): not ours to answer
            if entry.stalled:
                # nothing more can reach a client that does not read: its connection is reset
                logger.warning("kvplug serve: request aborted: %s", entry.abort_reason)
                return
            await self._answer_aborted(entry, send)
        finally:
            with self._lock:
                self._running.pop(id(entry), None)
            if not entry.finished:
                # aborted, stalled or disconnected before its last byte: stop its generation and
                # free its row (transformers' own cancel runs only when its stream is closed)
                for cancel in entry.cancels:
                    cancel()

    async def _wait(self, entry: _Running) -> None:
        """Await the request's task, or its abort and then at most ``ABORT_GRACE_S`` for the
        task to end (raising ``CancelledError``): an aborted request never holds its slot on a
        task stuck in a send. Cancelled from outside, the task is cancelled too."""
        task = entry.task
        aborted = asyncio.ensure_future(entry.aborted.wait())
        try:
            await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait({task}, timeout=ABORT_GRACE_S)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            aborted.cancel()
        if not task.done():
            logger.warning("kvplug serve: an aborted request's task did not end within %g s of its abort (%s); "
                           "its slot is released, the task left to end on its own", ABORT_GRACE_S, entry.abort_reason)
            task.add_done_callback(_retrieve)
            raise asyncio.CancelledError()
        await task  # its result: returns, raises its error, or CancelledError once aborted

    async def _answer_aborted(self, entry: _Running, send: Callable) -> None:
        """The aborted request's last words (a 503, or an error event ending its stream), sent
        within the stall timeout; a client that does not take them has its connection reset."""
        refusal = RequestRefused(entry.abort_reason or "aborted", status=503)

        async def answer() -> None:
            if not entry.started:
                await send_refusal(send, refusal)
            elif not entry.finished:
                if entry.streaming:
                    event = f"data: {json.dumps(refusal.to_json())}\n\n".encode()
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await asyncio.wait_for(answer(), self.stall_timeout)
        except asyncio.TimeoutError:
            if entry.abort_connection is not None:
                entry.abort_connection()
        except Exception:  # the client is gone or the connection closed: nothing left to tell it
            pass


_TIMEOUT = getattr(asyncio, "timeout", None)  # Python 3.11+


async def send_within(send: Callable, message: dict, seconds: float | None) -> None:
    """``send(message)``, raising ``asyncio.TimeoutError`` past ``seconds``: a timer on the running
    task (``asyncio.wait_for`` of Python 3.11 starts a task per call: per streamed chunk)."""
    if _TIMEOUT is None:
        await asyncio.wait_for(send(message), seconds)
        return
    async with _TIMEOUT(seconds):
        await send(message)


def _retrieve(task: asyncio.Task) -> None:
    """Collect the outcome of a task nobody awaits any more (no "exception never retrieved")."""
    if not task.cancelled():
        task.exception()


_TRANSFORMERS_STREAM_ERROR = re.compile(rb'data: \{"error": "(.*)"\}\n\n\Z', re.DOTALL)


def openai_stream_error(body: bytes) -> bytes:
    """transformers ends a failed stream with ``data: {"error": "<text>"}`` (the text unescaped,
    so not always JSON); rewrite that last event in OpenAI's error shape, which clients report
    with its message."""
    match = _TRANSFORMERS_STREAM_ERROR.search(body)
    if match is None:
        return body
    text = match.group(1).decode("utf-8", errors="replace")
    refusal = RequestRefused(f"generation failed: {text}", status=500)
    return body[: match.start()] + f"data: {json.dumps(refusal.to_json())}\n\n".encode()


def wrap_app(app: Any, *, api_key: str | None, max_request_bytes: int, inflight: InFlightRequests) -> None:
    """Put the guards in front of a FastAPI app (before it starts): API key, then body size,
    then in-flight tracking."""
    app.add_middleware(_Adapter, wrap=inflight.middleware)
    app.add_middleware(BodySizeLimit, limit=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)


class _Adapter:
    """Starlette middleware from a function that wraps an ASGI app."""

    def __init__(self, app: ASGIApp, wrap: Callable[[ASGIApp], ASGIApp]) -> None:
        self._wrapped = wrap(app)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self._wrapped(scope, receive, send)
