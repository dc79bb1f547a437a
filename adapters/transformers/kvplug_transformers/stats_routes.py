"""``GET /kvplug/stats``: the server's KV-cache statistics as JSON.

With ``--kv-backend kvplug``: ``HostStats.to_json()`` (hit tokens, evictions, utilisation, ...)
plus ``"kv_backend": "kvplug"`` and ``"model"`` (the model id requests must name). With
``native``: what transformers' own cache exposes (``cache_hit_tokens`` from its prefix-sharing
counter, block counts) once it exists.
"""

from __future__ import annotations

from typing import Any


def add_stats_routes(app: Any, adapter: Any, opts: Any, model: str, generation_state: Any) -> None:
    """``model`` is the id requests must name (transformers pins the server to it)."""
    from fastapi.responses import JSONResponse

    def kvplug_stats() -> JSONResponse:
        if opts.kv_backend == "kvplug":
            return JSONResponse({"kv_backend": "kvplug", "model": model, **adapter.stats().to_json()})
        return JSONResponse({"kv_backend": "native", "model": model, **_native_stats(generation_state)})

    app.add_api_route("/kvplug/stats", kvplug_stats, methods=["GET"])


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
