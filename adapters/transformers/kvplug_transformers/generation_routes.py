"""kvplug's own ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` routes
in place of transformers' (which parse the body on the event loop and take the client's
``X-Request-ID`` as the batching worker's request id: two requests with one id killed the worker).

Here every request gets the server's own unique id (``kvplug-<hex>``); a client's
``X-Request-ID`` is only echoed in the response and logged. The body is parsed and checked off
the event loop (``request_json``, ``request_bodies``), then answered by the ``GuardedHandler``.
"""

import copy
import logging
import time
import uuid
from typing import Any, Callable

from kvplug_transformers.handler_guards import GuardedHandler
from kvplug_transformers.http_guards import CANCEL_KEY
from kvplug_transformers.multi_prompt import answer_all, split_bodies
from kvplug_transformers.prompt_tokens import OffLoopTokenizer
from kvplug_transformers.request_bodies import multiple_prompts
from kvplug_transformers.request_json import parse_body
from kvplug_transformers.serve_metrics import ServeMetrics

logger = logging.getLogger("kvplug.serve")
X_REQUEST_ID = "x-request-id"
MAX_ECHOED_ID = 200  # characters of a client's X-Request-ID echoed back; a longer one is not echoed
COMPLETIONS = "/v1/completions"  # the route whose body may hold several prompts
TRANSFORMERS_MIDDLEWARE = "request_id_middleware"  # transformers' middleware that reads X-Request-ID


def new_request_id() -> str:
    return f"kvplug-{uuid.uuid4().hex}"


def add_generation_routes(
    app: Any, guarded: dict[str, GuardedHandler], pool: OffLoopTokenizer, cancel: Callable[[str], None],
    metrics: ServeMetrics | None = None,
) -> None:
    """Replace transformers' generation routes (and its X-Request-ID middleware) on ``app``;
    ``cancel(request_id)`` stops a generation (called when its response cannot be finished);
    ``metrics`` gets every answered response's latencies (``/metrics``)."""
    from fastapi import Request

    app.router.routes[:] = [
        route for route in app.router.routes
        if not (getattr(route, "path", None) in guarded and "POST" in getattr(route, "methods", ()))
    ]
    app.user_middleware[:] = [
        middleware for middleware in app.user_middleware
        if getattr(middleware.kwargs.get("dispatch"), "__name__", None) != TRANSFORMERS_MIDDLEWARE
    ]

    def route_for(path: str, handler: GuardedHandler) -> Any:
        def prepare(raw: bytes) -> tuple[dict, dict]:
            body = parse_body(raw)
            handler.check(body)
            return body, copy.deepcopy(body)

        async def generate(request: Request) -> Any:
            started = time.monotonic()
            request_id = new_request_id()
            client_id = request.headers.get(X_REQUEST_ID)
            if client_id is not None:
                logger.debug("request %s: the client calls it %r", request_id, client_id[:MAX_ECHOED_ID])
            first, second = await pool.call(prepare, await request.body())
            cancels = request.scope.get(CANCEL_KEY)
            prompts = multiple_prompts(first) if path == COMPLETIONS else None
            if prompts is not None:  # one request of the batch per prompt, answered as one (multi_prompt)
                bodies = split_bodies(first, prompts)

                async def answer(index: int) -> Any:
                    one_id = f"{request_id}-{index}"
                    if cancels is not None:
                        cancels.append(lambda: cancel(one_id))
                    return await handler.handle(bodies[index], copy.deepcopy(bodies[index]), one_id)

                response = await answer_all(prompts, answer, request_id)
            else:
                if cancels is not None:
                    cancels.append(lambda: cancel(request_id))
                response = await handler.handle(first, second, request_id)
            echoed = client_id if client_id is not None and len(client_id) <= MAX_ECHOED_ID else request_id
            response.headers[X_REQUEST_ID] = echoed
            if metrics is not None:
                _record_latencies(response, metrics, started)
            return response

        return generate

    for path, handler in guarded.items():
        app.add_api_route(path, route_for(path, handler), methods=["POST"], response_model=None)


def _record_latencies(response: Any, metrics: ServeMetrics, started: float) -> None:
    """A streamed response's first chunk and later gaps as it is sent; any other its whole time now."""
    body = getattr(response, "body_iterator", None)
    if body is None:
        metrics.observe(e2e_s=time.monotonic() - started)
        return

    async def timed() -> Any:
        first, previous, gaps = None, None, []
        try:
            async for chunk in body:
                now = time.monotonic()
                if first is None:
                    first = now - started
                else:
                    gaps.append(now - previous)
                previous = now
                yield chunk
        finally:
            metrics.observe(e2e_s=time.monotonic() - started, first_chunk_s=first, chunk_gaps_s=gaps)

    response.body_iterator = timed()
