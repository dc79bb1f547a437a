"""``kvplug serve --api-server-count N``: N HTTP processes (API servers) over one engine process,
as vLLM's ``--api-server-count``.

One streamed token costs the HTTP process's one interpreter its share of detokenising and of
writing the chunk; with many streams that interpreter, not the engine, bounds the throughput.
The main process binds the listening socket once and makes one pipe per API server; it is API
server 0 (it starts the engine process with every pipe, ``engine_client``) and starts the other
N - 1 (``run_api_server``: ``kvplug serve`` itself, attached to its pipe and serving the shared
socket: the kernel hands each accepted connection to one of them). Each detokenises its own
requests; the engine routes each request's outputs back to its API server (``engine_links``).

The main process watches the others: one exiting by itself stops the server (exit 2), a stop
signal is passed on to them, and they are waited for (killed at the bound) before the engine stops.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvplug.interface import InvalidArgumentError, KVPlugError

logger = logging.getLogger("kvplug.serve")
API_SERVER_HEADER = b"x-kvplug-api-server"  # which API server answered (N > 1 only)
PROCESS_NAME = "kvplug-api-{}"  # the other API servers' name in ps / top (and for kvplug bench serve's CPU split)
JOIN_POLL_S = 0.05


@dataclass(frozen=True)
class ApiServerRole:
    """One API server's part.

    Attributes:
        index: 0 for the main process, 1 .. count - 1 for the others.
        count: ``--api-server-count``.
        sock: the shared listening socket.
        connection: this API server's end of its pipe to the engine.
        engine_ends: API server 0 only: the engine's ends of every pipe, its own first.
        ready: set by an API server (not 0) once it serves: API server 0 is healthy only then.
    """

    index: int
    count: int
    sock: socket.socket
    connection: Any
    engine_ends: tuple = ()
    ready: Any = None


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """The socket every API server accepts on, bound and listening (uvicorn's options)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise KVPlugError(f"port {port} on {host} is already in use (--port)") from error
        raise KVPlugError(f"cannot listen on {host}:{port}: {error}") from error
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


class ApiServers:
    """The main process's side: the socket, the pipes, and API servers 1 .. N - 1."""

    def __init__(self, count: int, host: str, port: int, backlog: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 2:
            raise InvalidArgumentError(f"ApiServers needs an api server count >= 2, got {count!r}")
        self._context = multiprocessing.get_context("spawn")  # the engine's rule: nothing inherited by accident
        self.sock = listening_socket(host, port, backlog)
        pipes = [self._context.Pipe(duplex=True) for _ in range(count)]
        self._ready = [self._context.Event() for _ in range(count)]
        self.own = ApiServerRole(0, count, self.sock, pipes[0][0], tuple(pipe[1] for pipe in pipes))
        self._others = [
            ApiServerRole(index, count, self.sock, pipes[index][0], (), self._ready[index]) for index in range(1, count)
        ]
        self._processes: list[Any] = []
        self._stopping = False

    def start(self, settings: Any, options: dict) -> None:
        """Start API servers 1 .. N - 1 (``options``: ``serve``'s, their own stats logging off)."""
        options = {**options, "stats_interval": 0}
        for role in self._others:
            process = self._context.Process(
                target=run_api_server,
                args=(role, settings, options),
                name=f"kvplug-api-server-{role.index}",
                daemon=True,
            )
            process.start()
            role.connection.close()  # theirs now: the engine sees them gone when they are
            self._processes.append(process)

    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def all_ready(self) -> bool:
        """Every other API server serves; raises if one exited meanwhile."""
        death = self.dead()
        if death is not None:
            raise KVPlugError(f"{death} while starting")
        return all(role.ready.is_set() for role in self._others)

    def dead(self) -> str | None:
        """Why an API server exited by itself (``None``: all run, or the stop was asked for)."""
        if self._stopping:
            return None
        for index, process in enumerate(self._processes, start=1):
            if process.exitcode is not None:
                return f"API server {index} exited (exit code {process.exitcode})"
        return None

    def running(self) -> bool:
        """Any of them still runs."""
        return any(process.exitcode is None for process in self._processes)

    def signal_stop(self) -> None:
        """Pass the stop on: each API server then stops as ``kvplug serve`` does on SIGTERM."""
        self._stopping = True
        for process in self._processes:
            if process.exitcode is None:
                try:
                    os.kill(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def join(self, deadline: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic()``) for every API server to exit, then kill
        what remains; ``True`` when all exited by themselves."""
        self._stopping = True
        while any(process.is_alive() for process in self._processes) and time.monotonic() < deadline:
            time.sleep(JOIN_POLL_S)
        clean = True
        for process in self._processes:
            if process.is_alive():
                clean = False
                process.kill()
                process.join(1.0)
        self.sock.close()
        return clean


def add_api_server_header(app: Any, index: int) -> None:
    """Every response names the API server that answered it (``x-kvplug-api-server``)."""
    app.add_middleware(_ApiServerHeader, value=str(index).encode())


class _ApiServerHeader:
    def __init__(self, app: Any, value: bytes) -> None:
        self._app = app
        self._header = (API_SERVER_HEADER, value)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self._header]
            await send(message)

        await self._app(scope, receive, send_named)


def run_api_server(role: ApiServerRole, settings: Any, options: dict) -> None:
    """API server ``role.index``'s process: ``kvplug serve`` on the shared socket, attached to the engine."""
    from kvplug_transformers.host import TransformersHost
    from kvplug_transformers.server import serve

    _name_process(PROCESS_NAME.format(role.index))
    try:
        code = serve(TransformersHost(settings), api_server=role, **options)
    except KVPlugError as error:
        print(f"kvplug serve: API server {role.index}: error: {error}", file=sys.stderr)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _name_process(name: str) -> None:
    """This process's name as ``ps`` and ``/proc/PID/comm`` show it (Linux; elsewhere unchanged)."""
    try:
        with open("/proc/self/comm", "w", encoding="ascii") as comm:
            comm.write(name[:15])  # the kernel keeps 15 characters
    except OSError:
        pass
