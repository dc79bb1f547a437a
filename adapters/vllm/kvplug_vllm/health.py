"""vLLM's ``/health`` reports a quarantined kvplug prefix cache, as ``kvplug serve``'s does.

The quarantine record lives in EngineCore's scheduler (``BlockQuarantine.as_dict``, in the
connector's snapshot) and already reaches the API server through vLLM's stats pipeline: the
``StatsBoard`` ``/kvplug/stats`` serves holds each engine's latest snapshot. vLLM's ``/health``
answers an empty 200 (503 once the engine is dead). ``QuarantineHealth``, an ASGI middleware that
``KvplugStatsEndpoint.attach_router`` puts on vLLM's app (``build_app`` calls it before the
middleware stack is built), lets vLLM answer first and, on its 200, reads the board: an engine
whose plugin was quarantined turns the answer into ``kvplug serve``'s shape, ``{"status":
"degraded", "prefix_cache": RECORD}`` with 200 (it still serves, on ``naive``). Reading the board
asks the engine nothing, so ``/health`` waits on kvplug's account for no engine step, however
busy the engine is. With no fault, or any answer but 200, vLLM's own answer goes out unchanged.
With ``on_cache_failure: "fail"`` a fault stops vLLM's engine (``quarantine``): vLLM's own
``/health`` then answers 503, which passes through unchanged, as for any dead engine; kvplug adds
no 503 of its own.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Mapping, Optional

from kvplug.health_override import Answer, answer_over_ok

HEALTH_PATH = "/health"
#: the snapshot's keys that make up the record (``BlockQuarantine.as_dict`` and the cache in use)
RECORD_KEYS = ("prefix_cache", "cache_failures", "last_cache_fault", "quarantined_prefix_cache")


def health_answer(engines: Mapping[int, Mapping[str, Any]]) -> Optional[tuple[int, dict]]:
    """``(status, body)`` when a kvplug prefix cache faulted on one of the ``engines`` (index ->
    latest snapshot), else ``None`` (vLLM's answer stands). The lowest faulted engine is named."""
    for index in sorted(engines):
        snapshot = engines[index]
        if snapshot.get("cache_failures"):
            record = {key: snapshot.get(key) for key in RECORD_KEYS}
            return 200, {"status": "degraded", "prefix_cache": {**record, "engine": index}}
    return None


def _route_path(scope: dict) -> str:
    """The path vLLM's router matches: without ``--root-path``'s prefix where the server put it in."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class QuarantineHealth:
    """ASGI middleware: vLLM's ``/health``, with the quarantine added.

    Args:
        app: the rest of vLLM's app (Starlette passes it).
        engines: returns each engine's latest kvplug snapshot (``StatsBoard.read``); must not block.
    """

    def __init__(self, app: Callable[..., Awaitable[None]],
                 engines: Callable[[], Mapping[int, Mapping[str, Any]]]) -> None:
        self.app = app
        self._engines = engines

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or _route_path(scope) != HEALTH_PATH:
            return await self.app(scope, receive, send)
        async def answer() -> Answer:
            return health_answer(self._engines())

        await answer_over_ok(self.app, scope, receive, send, answer)
