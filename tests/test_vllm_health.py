"""``kvplug_vllm.health.QuarantineHealth`` on vLLM 0.32.0's own ``/health`` route, without an engine:
the endpoint plugin's ``attach_router`` on a FastAPI app carrying vLLM's health router, with a
stand-in engine client. vLLM's answer passes unchanged until an engine's snapshot on the board
reports a fault, then it is ``kvplug serve``'s ``degraded`` 200; vLLM's 503 (engine dead) stands, and
an engine that never answers ``check_health`` is vLLM's wait, not kvplug's. The real server:
``tests/test_vllm_server.py::test_vllm_serve_quarantines_a_faulty_plugin_and_reports_it``."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test-vllm-host.sh builds its environment)")
pytest.importorskip("kvplug_vllm", reason="kvplug-vllm is not installed (pip install -e adapters/vllm)")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from vllm.entrypoints.serve.instrumentator.health import router as vllm_health_router  # noqa: E402
from vllm.v1.engine.exceptions import EngineDeadError  # noqa: E402

from kvplug_vllm.health import health_answer  # noqa: E402
from kvplug_vllm.stats_route import KvplugStatsEndpoint, StatsBoard  # noqa: E402

CLEAN = {"prefix_cache": "faulty", "cache_failures": 0, "last_cache_fault": None, "quarantined_prefix_cache": None,
         "lookups": 3}
QUARANTINED = {**CLEAN, "prefix_cache": "naive", "cache_failures": 1, "last_cache_fault": "outside the pool",
               "quarantined_prefix_cache": "faulty"}
RECORD = {"prefix_cache": "naive", "cache_failures": 1, "last_cache_fault": "outside the pool",
          "quarantined_prefix_cache": "faulty"}


class EngineClient:
    """What vLLM's health route asks of the engine: ``check_health`` (raises when dead)."""

    def __init__(self) -> None:
        self.dead = False

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError()


def served(board: StatsBoard, engine: EngineClient) -> TestClient:
    app = FastAPI()
    app.include_router(vllm_health_router)
    KvplugStatsEndpoint(board).attach_router(app)  # as vLLM's build_app does, before serving
    app.state.engine_client = engine
    return TestClient(app)


def test_vllm_answer_passes_until_a_quarantine_then_degraded() -> None:
    board, engine = StatsBoard(), EngineClient()
    client = served(board, engine)
    answer = client.get("/health")
    assert (answer.status_code, answer.content) == (200, b"")  # no snapshot yet: vLLM's own answer
    board.publish(0, CLEAN)
    answer = client.get("/health")
    assert (answer.status_code, answer.content) == (200, b"")
    board.publish(1, QUARANTINED)
    answer = client.get("/health")
    assert answer.status_code == 200 and answer.json() == {"status": "degraded",
                                                           "prefix_cache": {**RECORD, "engine": 1}}
    assert client.get("/kvplug/stats").json()["engines"]["1"]["cache_failures"] == 1  # the same board
    engine.dead = True
    answer = client.get("/health")
    assert (answer.status_code, answer.content) == (503, b"")  # vLLM's engine-dead answer stands


def test_health_answer_names_the_lowest_faulted_engine() -> None:
    assert health_answer({}) is None
    assert health_answer({0: CLEAN, 1: {"prefix_cache": "radix", "bound": False}}) is None
    assert health_answer({2: QUARANTINED, 0: CLEAN, 1: QUARANTINED}) == (
        200, {"status": "degraded", "prefix_cache": {**RECORD, "engine": 1}})


def test_other_paths_and_root_path_go_straight_through() -> None:
    board = StatsBoard()
    board.publish(0, QUARANTINED)
    client = served(board, EngineClient())
    assert client.get("/kvplug/stats").status_code == 200
    sent: list[dict] = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message):
        sent.append(message)

    from kvplug_vllm.health import QuarantineHealth

    middleware = QuarantineHealth(app, board.read)
    asyncio.run(middleware({"type": "http", "path": "/v1/health", "root_path": ""}, None, send))
    assert sent[0]["status"] == 200 and sent[1]["body"] == b""
    sent.clear()
    asyncio.run(middleware({"type": "http", "path": "/api/health", "root_path": "/api"}, None, send))
    assert b"degraded" in sent[1]["body"]
