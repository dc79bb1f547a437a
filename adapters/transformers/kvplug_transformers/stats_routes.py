"""kvplug's routes on transformers' FastAPI app: ``/kvplug/stats``, ``/health``, ``/v1/models``.

``GET /kvplug/stats``: with ``--kv-backend kvplug``, ``HostStats.to_json()`` (hit tokens,
evictions, utilisation, ...); with ``native``, what transformers' own cache exposes
(``cache_hit_tokens`` from its prefix-sharing counter, block counts) once it exists. Both add
``kv_backend``, ``model`` (the served model name), ``max_context_len``, ``in_flight`` and
``worker`` (``{"alive": bool, "error": str | None}``), and ``kv_events`` (the KV event
publisher's counters with ``--kv-events-config``, else ``null``); the answer is 503 once the batching worker
has died. ``/health`` and ``/v1/models`` replace transformers' own: its health check does not see
a closing server, and its model list scans the Hugging Face hub cache (500 without one) instead of
naming the model this server serves. transformers' ``/reset``, ``/load_model`` and
``/v1/audio/transcriptions`` are removed (see ``REMOVED_ROUTES``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from kvplug_transformers.http_guards import InFlightRequests
from kvplug_transformers.request_limits import RequestRefused
from kvplug_transformers.worker_watch import WorkerWatch

REPLACED_ROUTES = frozenset({"/health", "/v1/models"})
# transformers' model-management routes: POST /reset unloads the one model this server is pinned
# to (under the running batching worker), POST /load_model fetches any Hub model; and a text model
# has no audio. Any client could use them to break the server: they are removed.
REMOVED_ROUTES = frozenset({"/reset", "/load_model", "/v1/audio/transcriptions"})


@dataclass(frozen=True)
class ServedModel:
    """Attributes:
    name: the id clients use (``--served-model-name``).
    path: the checkpoint directory (also accepted as a model id).
    created: Unix time the server started.
    """

    name: str
    path: str
    created: int

    def accepts(self, requested: Any) -> bool:
        return requested is None or requested in (self.name, self.path, f"{self.path}@main")

    def card(self, max_context_len: int) -> dict:
        return {
            "id": self.name, "object": "model", "created": self.created, "owned_by": "kvplug",
            "root": self.name, "max_model_len": max_context_len,  # never the server's own paths
        }


def add_kvplug_routes(
    app: Any, adapter: Any, opts: Any, served: ServedModel, generation_state: Any, watch: WorkerWatch,
    inflight: InFlightRequests, connections: Any = None, ready: threading.Event | None = None,
) -> None:
    """``connections``: the server's ``ConnectionLimits`` (their counters are in the stats);
    ``ready``: set once the KV pool is built and the worker runs (``None``: ready from the start);
    until then ``/health`` and ``/kvplug/stats`` answer 503 ``starting``."""
    from fastapi.responses import JSONResponse

    app.router.routes[:] = [
        route for route in app.router.routes if getattr(route, "path", None) not in REPLACED_ROUTES | REMOVED_ROUTES
    ]

    def worker_state() -> dict:
        error = watch.worker_error()
        return {"alive": error is None, "error": error}

    def kvplug_stats() -> JSONResponse:
        cache = adapter.stats().to_json() if opts.kv_backend == "kvplug" else _native_stats(generation_state)
        worker = worker_state()
        body = {
            "kv_backend": opts.kv_backend, "model": served.name, "max_context_len": watch.limits.max_context_len,
            **cache, "in_flight": inflight.count(), "worker": worker,
            "kv_events": adapter.kv_events_stats() if opts.kv_backend == "kvplug" else None,  # issue 27
            "connections": {**(connections.to_json() if connections is not None else {}),
                            "stalled_streams": inflight.stalled_total},
        }
        starting = ready is not None and not ready.is_set()
        body["status"] = "starting" if starting else "ok" if worker["alive"] else "unhealthy"
        return JSONResponse(body, status_code=200 if worker["alive"] and not starting else 503)

    def health() -> JSONResponse:
        worker = worker_state()
        if not worker["alive"]:
            return JSONResponse({"status": "unhealthy", "reason": f"the batching worker died: {worker['error']}"}, 503)
        if ready is not None and not ready.is_set():
            return JSONResponse({"status": "starting", "reason": "building the KV pool and starting the batching worker"},
                                503)
        if inflight.closed_reason is not None:
            return JSONResponse({"status": "unavailable", "reason": inflight.closed_reason}, 503)
        guard = adapter.stats().cache_guard if opts.kv_backend == "kvplug" else None
        if guard and guard.get("stopped"):  # --on-cache-failure fail: the faulty cache stopped the backend
            return JSONResponse({"status": "unhealthy", "reason": f"prefix cache fault: {guard.get('last_cache_fault')}",
                                 "prefix_cache": guard}, 503)
        if guard and guard.get("cache_failures"):  # serving on the fallback cache
            return JSONResponse({"status": "degraded", "prefix_cache": guard})
        return JSONResponse({"status": "ok"})

    def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [served.card(watch.limits.max_context_len)]})

    def get_model(model_id: str) -> JSONResponse:
        if model_id != served.name:
            raise RequestRefused(
                f"The model '{model_id}' does not exist; this server serves '{served.name}'", status=404, param="model"
            )
        return JSONResponse(served.card(watch.limits.max_context_len))

    # response_model=None: the return annotations are strings here, which /openapi.json cannot resolve
    app.add_api_route("/kvplug/stats", kvplug_stats, methods=["GET"], response_model=None)
    app.add_api_route("/health", health, methods=["GET"], response_model=None)
    app.add_api_route("/v1/models", list_models, methods=["GET"], response_model=None)
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"], response_model=None)

    async def refused(_request: Any, error: RequestRefused) -> JSONResponse:
        return JSONResponse(error.to_json(), status_code=error.status)

    async def worker_dead(_request: Any, error: Exception) -> JSONResponse:
        refusal = RequestRefused(f"the batching worker died: {error}", status=503)
        return JSONResponse(refusal.to_json(), status_code=503)

    async def failed(_request: Any, error: Exception) -> JSONResponse:
        # a generation that failed in the worker (transformers raises RuntimeError) or a bug:
        # still an OpenAI-shaped error, so clients show its message; the traceback is logged
        refusal = RequestRefused(f"internal error: {type(error).__name__}: {error}", status=500)
        return JSONResponse(refusal.to_json(), status_code=500)

    from transformers.cli.serving.utils import CBWorkerDeadError

    app.add_exception_handler(RequestRefused, refused)
    app.add_exception_handler(CBWorkerDeadError, worker_dead)  # transformers' own answers {"error": str}
    app.add_exception_handler(Exception, failed)


def _native_stats(generation_state: Any) -> dict:
    """Read transformers' paged cache through its private attributes (absent until the first request)."""
    manager = getattr(getattr(generation_state, "_cb_manager", None), "_cb", None)
    processor = getattr(manager, "batch_processor", None)
    cache = getattr(processor, "cache", None)
    if cache is None:
        return {"cache_hit_tokens": 0, "num_pages": 0, "free_pages": 0, "utilisation": 0.0}
    num_blocks, free = int(cache.num_blocks), int(cache.get_num_free_blocks())
    return {
        "cache_hit_tokens": int(getattr(cache, "_total_prefix_length", 0)),
        "num_pages": num_blocks,
        "free_pages": free,
        "page_size": int(cache.block_size),
        "utilisation": (num_blocks - free) / num_blocks if num_blocks else 0.0,
    }


def served_model(name: str, path: str) -> ServedModel:
    return ServedModel(name=name, path=path, created=int(time.time()))
