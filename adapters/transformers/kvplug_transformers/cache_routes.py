"""``POST /flush_cache`` (SGLang's name) and ``POST /reset_prefix_cache`` (vLLM's): empty the prefix cache.

The batching thread is the prefix cache's one driver, so a route only asks
(``KVPlugPagedCache.request_flush``) and waits for the thread's next scheduling pass, at most
``FLUSH_TIMEOUT_S``; requests running meanwhile keep their prefixes until they finish. The pages go
back to the free list and, with ``--kv-events-config``, routers hear ``AllBlocksCleared``. A cache
with a host-memory tier cannot be flushed yet (400 saying so); with ``--kv-backend native``, 400.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from kvplug.interface import KVPlugError

from kvplug_transformers.request_limits import RequestRefused

FLUSH_TIMEOUT_S = 30.0
FLUSH_ROUTES = ("/flush_cache", "/reset_prefix_cache")


def add_cache_routes(app: Any, adapter: Any, opts: Any) -> None:
    from fastapi.responses import JSONResponse

    async def flush() -> JSONResponse:
        if opts.kv_backend != "kvplug":
            raise RequestRefused("flushing the prefix cache needs --kv-backend kvplug (transformers' own cache "
                                 "has no flush here)")
        caches = adapter.live_caches()
        if not caches:
            raise RequestRefused("the KV cache is not built yet (the server is starting)", status=503)
        futures = [cache.request_flush() for cache in caches]
        try:
            freed = [await asyncio.wait_for(asyncio.wrap_future(future), FLUSH_TIMEOUT_S) for future in futures]
        except asyncio.TimeoutError as error:
            for future in futures:
                future.cancel()  # not started: never runs
            raise RequestRefused(f"the batching thread did not take the flush within {FLUSH_TIMEOUT_S:g} s",
                                 status=503) from error
        except (KVPlugError, concurrent.futures.CancelledError) as error:
            raise RequestRefused(f"the prefix cache was not flushed: {error}") from error
        return JSONResponse({"status": "ok", "freed_pages": sum(freed)})

    for path in FLUSH_ROUTES:
        app.add_api_route(path, flush, methods=["POST"], response_model=None)
