"""The batching worker's warm-up before ``kvplug serve`` says ready: kvplug's decode CUDA graphs.

transformers' serving starts its worker without a warm-up, and kvplug's cache would capture its
decode graphs at the first decode-only step: that request would pay the capture, and ``/health``
would say ready before the engine can serve at speed. ``request_warmup`` asks the worker's kvplug
cache to capture them on the batching thread at its next scheduling pass, before it schedules any
request (``KVPlugPagedCache.request_warmup``); the server (in-process ``HttpServer.start_worker``,
or the engine process before ``READY``) waits for the future before it reports ready.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any


def request_warmup(batching_manager: Any, model: Any) -> concurrent.futures.Future | None:
    """The warm-up future of ``batching_manager``'s kvplug cache (its ``batch_processor`` is
    built), or ``None`` when there is nothing to wait for (transformers' own cache, or the cache
    of an engine process, which warms up before it reports ready)."""
    cache = getattr(getattr(batching_manager, "batch_processor", None), "cache", None)
    request = getattr(cache, "request_warmup", None)
    return None if request is None else request(getattr(batching_manager, "model", model))
