"""``FrontendLinks``: the engine process's connections to its frontends, one per API server
(``kvplug serve --api-server-count N``; one with ``--engine-process`` alone).

Each frontend names its requests itself; with more than one, the engine's id of a request is its
frontend's id under that frontend's namespace (``api<index>:<id>``), so two frontends can never
collide in the batching manager, and each request's outputs go back to the frontend that sent it,
under the frontend's own id. The first frontend owns the engine: its stop (or its connection
closing) stops the engine; any other one's only detaches it (its requests are cancelled).
"""

from __future__ import annotations

import threading
from multiprocessing.connection import wait
from typing import Any, Iterator

from kvplug_transformers import engine_protocol as protocol

OWNER = 0  # the frontend whose stop stops the engine


class FrontendLinks:
    """The connections, their send locks, and which request came from which frontend."""

    def __init__(self, conns: list[Any]) -> None:
        self._conns: dict[int, Any] = dict(enumerate(conns))
        self._locks = {index: threading.Lock() for index in self._conns}
        self._single = len(conns) == 1  # --engine-process alone: ids and messages exactly as before
        self._routes: dict[str, tuple[int, str]] = {}  # engine id -> (frontend, the frontend's id)
        self._routes_lock = threading.Lock()

    def receive(self) -> Iterator[tuple[int, tuple | None]]:
        """The next messages, each with its frontend's index (``None``: that connection closed)."""
        if self._single:
            try:
                yield OWNER, self._conns[OWNER].recv()
            except (EOFError, OSError):
                yield OWNER, None
            return
        by_conn = {conn: index for index, conn in self._conns.items()}
        for conn in wait(list(by_conn)):
            try:
                yield by_conn[conn], conn.recv()
            except (EOFError, OSError):
                yield by_conn[conn], None

    def engine_id(self, frontend: int, request_id: str) -> str:
        return request_id if self._single else f"api{frontend}:{request_id}"

    def admit(self, frontend: int, request_id: str) -> str:
        """The engine's id of a frontend's new request, its outputs routed back to that frontend."""
        engine_id = self.engine_id(frontend, request_id)
        if not self._single:
            with self._routes_lock:
                self._routes[engine_id] = (frontend, request_id)
        return engine_id

    def forget(self, engine_id: str) -> None:
        if not self._single:
            with self._routes_lock:
                self._routes.pop(engine_id, None)

    def send(self, frontend: int, message: tuple) -> None:
        """One message to one frontend; a detached or gone one (not the owner) is skipped."""
        conn = self._conns.get(frontend)
        if conn is None:
            return
        try:
            with self._locks[frontend]:
                conn.send(message)
        except OSError:
            if frontend == OWNER:
                raise
            self.detach(frontend)

    def broadcast(self, message: tuple) -> None:
        for frontend in list(self._conns):
            self.send(frontend, message)

    def send_outputs(self, items: list[protocol.StepOutput]) -> None:
        """One ``STEP`` per frontend with its requests' outputs, under its own ids."""
        if self._single:
            self.send(OWNER, (protocol.STEP, items))
            return
        grouped: dict[int, list[protocol.StepOutput]] = {}
        with self._routes_lock:
            for item in items:
                route = self._routes.get(item.request_id)
                if route is None:
                    continue  # cancelled, or its frontend detached
                if item.finished:
                    del self._routes[item.request_id]
                grouped.setdefault(route[0], []).append(item._replace(request_id=route[1]))
        for frontend, outputs in grouped.items():
            self.send(frontend, (protocol.STEP, outputs))

    def detach(self, frontend: int) -> list[str]:
        """Stop serving a frontend (not the owner); returns the engine ids of its requests."""
        conn = self._conns.pop(frontend, None)
        if conn is not None:
            with self._locks[frontend]:  # never while the sender writes to it
                try:
                    conn.close()
                except OSError:
                    pass
        with self._routes_lock:
            mine = [engine_id for engine_id, route in self._routes.items() if route[0] == frontend]
            for engine_id in mine:
                del self._routes[engine_id]
        return mine
