"""SGLang's ``/health`` reports a quarantined kvplug prefix cache, as ``kvplug serve``'s does.

The quarantine record lives in the scheduler (``CacheQuarantine.as_dict``, added to its internal
state by ``hooks.after_get_internal_state``); SGLang's ``/health`` answers from the HTTP process
with an empty 200. ``QuarantineHealth``, an ASGI middleware on SGLang's FastAPI ``app``, lets
SGLang answer first and, on its 200, asks the schedulers for their internal state (what
``/server_info`` reads): a rank whose plugin was quarantined turns the answer into ``kvplug
serve``'s shape, ``{"status": "degraded", "prefix_cache": RECORD}`` with 200 (it still serves,
on the fallback cache), or ``{"status": "unhealthy", "reason": ..., "prefix_cache": RECORD}``
with 503 for one stopped by ``--kvplug-on-cache-failure fail``. With no fault SGLang's own answer
goes out unchanged. A scheduler that does not answer within ``STATE_TIMEOUT_S`` leaves SGLang's
answer as it is: ``/health`` never waits longer on kvplug's account.

It is added by ``install_on_http_app`` from the hook after ``TokenizerManager.__init__`` in the
HTTP server's process (before uvicorn starts), which hands it the tokenizer manager.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any, Awaitable, Callable

from kvplug.health_override import answer_over_ok

logger = logging.getLogger(__name__)

HEALTH_PATHS = frozenset({"/health", "/health_generate"})
HTTP_SERVER_MODULE = "sglang.srt.entrypoints.http_server"
RECORD_KEY = "kvplug_prefix_cache"  # hooks.after_get_internal_state's key in a rank's internal state
STATE_TIMEOUT_S = 5.0  # the most /health waits for the schedulers' state
_INSTALLED_FLAG = "_kvplug_quarantine_health"


def health_answer(states: list) -> tuple[int, dict] | None:
    """``(status, body)`` for the ranks' internal ``states`` when a kvplug prefix cache faulted
    on one of them, else ``None`` (SGLang's answer stands). A stopped rank outranks a degraded one."""
    records = [state.get(RECORD_KEY) for state in states if isinstance(state, dict)]
    faulted = [record for record in records if isinstance(record, dict) and record.get("cache_failures")]
    if not faulted:
        return None
    stopped = [record for record in faulted if record.get("stopped")]
    if stopped:
        record = stopped[0]
        return 503, {"status": "unhealthy", "reason": f"prefix cache fault: {record.get('last_cache_fault')}",
                     "prefix_cache": record}
    return 200, {"status": "degraded", "prefix_cache": faulted[0]}


class QuarantineHealth:
    """ASGI middleware: SGLang's ``/health`` and ``/health_generate``, with the quarantine added."""

    def __init__(self, app: Callable[..., Awaitable[None]], state: Callable[[], Awaitable[list]]) -> None:
        self.app = app
        self._state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") not in HEALTH_PATHS:
            return await self.app(scope, receive, send)
        await answer_over_ok(self.app, scope, receive, send, self._answer)

    async def _answer(self) -> tuple[int, dict] | None:
        try:
            states = await asyncio.wait_for(self._state(), STATE_TIMEOUT_S)
        except Exception as error:  # SGLang's own answer stands; the schedulers are its business
            logger.debug("kvplug: /health could not read the schedulers' state: %r", error)
            return None
        return health_answer(states if isinstance(states, list) else [])


def install_on_http_app(tokenizer_manager: Any) -> bool:
    """Put ``QuarantineHealth`` on SGLang's HTTP ``app`` when this process serves it (its module is
    imported) and its middleware stack is not built yet; returns whether it did."""
    http_server = sys.modules.get(HTTP_SERVER_MODULE)
    app = getattr(http_server, "app", None)
    if app is None or getattr(app, _INSTALLED_FLAG, False):
        return False
    if getattr(app, "middleware_stack", None) is not None:  # already serving: Starlette refuses new middleware
        logger.warning("kvplug: SGLang's HTTP app is already serving; /health will not report a quarantine")
        return False
    app.add_middleware(QuarantineHealth, state=tokenizer_manager.get_internal_state)
    setattr(app, _INSTALLED_FLAG, True)
    return True
