"""``kvplug_sglang.health.QuarantineHealth`` without SGLang: SGLang's ``/health`` answer passes
unchanged until a rank's kvplug prefix cache was quarantined, then it is ``kvplug serve``'s shape
(``degraded`` 200 on the fallback, ``unhealthy`` 503 once stopped); a scheduler that does not
answer leaves SGLang's answer alone. The real server: ``tests/test_sglang_server_cache_faults.py``."""

from __future__ import annotations

import asyncio
import json

import pytest

health = pytest.importorskip(
    "kvplug_sglang.health", reason="kvplug-sglang is not installed: pip install -e adapters/sglang"
)

CLEAN = {"prefix_cache": "faulty", "cache_failures": 0, "last_cache_fault": None, "on_cache_failure": "fallback",
         "stopped": False, "quarantined_prefix_cache": None}
QUARANTINED = {**CLEAN, "prefix_cache": "naive", "cache_failures": 1, "last_cache_fault": "outside the pool",
               "quarantined_prefix_cache": "faulty"}
STOPPED = {**CLEAN, "cache_failures": 1, "last_cache_fault": "outside the pool", "on_cache_failure": "fail",
           "stopped": True}


def _get(path: str, states, sglang_status: int = 200) -> tuple[int, bytes]:
    async def sglang_app(scope, receive, send):
        await send({"type": "http.response.start", "status": sglang_status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def state():
        if isinstance(states, Exception):
            raise states
        return states

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(health.QuarantineHealth(sglang_app, state)({"type": "http", "path": path}, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_sglang_answer_passes_until_a_quarantine():
    assert _get("/health", [{"page_size": 1, "kvplug_prefix_cache": CLEAN}]) == (200, b"")
    assert _get("/health", [{"page_size": 1}]) == (200, b"")  # SGLang's own tree cache
    status, body = _get("/health", [{"kvplug_prefix_cache": CLEAN}, {"kvplug_prefix_cache": QUARANTINED}])
    assert status == 200 and json.loads(body) == {"status": "degraded", "prefix_cache": QUARANTINED}
    status, body = _get("/health_generate", [{"kvplug_prefix_cache": QUARANTINED}])
    assert status == 200 and json.loads(body)["status"] == "degraded"


def test_a_stopped_cache_is_unhealthy_and_sglang_failures_stand():
    status, body = _get("/health", [{"kvplug_prefix_cache": QUARANTINED}, {"kvplug_prefix_cache": STOPPED}])
    assert status == 503 and json.loads(body) == {
        "status": "unhealthy", "reason": "prefix cache fault: outside the pool", "prefix_cache": STOPPED}
    assert _get("/health", [{"kvplug_prefix_cache": QUARANTINED}], sglang_status=503) == (503, b"")
    assert _get("/health", TimeoutError("no scheduler")) == (200, b"")
    assert _get("/v1/models", [{"kvplug_prefix_cache": QUARANTINED}]) == (200, b"")  # not a health path
