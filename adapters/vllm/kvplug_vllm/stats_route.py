"""``GET /kvplug/stats`` on vLLM's API server: kvplug's prefix-cache counters, per engine.

The counters live in EngineCore's scheduler (``KvplugConnector.snapshot``) and reach the API
server through vLLM's own stats pipeline (``SchedulerStats.kv_connector_stats``, sent when they
change). Two plugins vLLM loads in the API-server process meet in one ``StatsBoard``:
``KvplugStatLogger`` (``vllm.stat_logger_plugins``) writes the latest snapshot of each engine into
it, ``KvplugStatsEndpoint`` (``vllm.endpoint_plugins``, opt-in: ``VLLM_PLUGINS`` must name
``kvplug``) serves it. vLLM instantiates each plugin itself and passes them nothing in common,
hence the one module-level board (``BOARD``); a test can pass its own to either class.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

from vllm.v1.metrics.loggers import StatLoggerBase

from kvplug_vllm.connector import STATS_KEY


class StatsBoard:
    """The latest kvplug snapshot of each engine (thread-safe: the route and the logger may race)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[int, dict[str, Any]] = {}

    def publish(self, engine_index: int, snapshot: dict[str, Any]) -> None:
        with self._lock:
            self._engines[engine_index] = dict(snapshot)

    def read(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            return {index: dict(snapshot) for index, snapshot in self._engines.items()}


BOARD = StatsBoard()


class KvplugStatLogger(StatLoggerBase):
    """A vLLM stat logger that keeps kvplug's snapshot from each step's scheduler stats."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, board: Optional[StatsBoard] = None) -> None:
        self.engine_index = engine_index
        self.board = BOARD if board is None else board

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        data = getattr(scheduler_stats, "kv_connector_stats", None) if scheduler_stats is not None else None
        if data and STATS_KEY in data:
            self.board.publish(engine_idx, data[STATS_KEY])

    def log_engine_initialized(self) -> None:
        return None


class KvplugStatsEndpoint:
    """vLLM endpoint plugin adding ``GET /kvplug/stats``, and the quarantine to ``/health`` (``health``)."""

    name = "kvplug"
    required_tasks = None  # any server with an engine

    def __init__(self, board: Optional[StatsBoard] = None) -> None:
        self.board = BOARD if board is None else board

    def attach_router(self, app: Any) -> None:
        from fastapi.responses import JSONResponse

        board = self.board

        async def kvplug_stats() -> JSONResponse:
            engines = board.read()
            body = {"engines": {str(index): snapshot for index, snapshot in sorted(engines.items())}}
            if not engines:
                body["detail"] = "no kvplug statistics yet: the engine reports them after its first step"
            return JSONResponse(body)

        app.add_api_route("/kvplug/stats", kvplug_stats, methods=["GET"], name="kvplug_stats")
        from kvplug_vllm.health import QuarantineHealth

        app.add_middleware(QuarantineHealth, engines=board.read)  # build_app has not built the stack yet

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        return None
