"""``GuardedH11Protocol``: uvicorn's HTTP/1.1 protocol with read deadlines and a connection cap.

uvicorn waits forever for a request's head and body, and accepts connections until the process
runs out of file descriptors. This subclass (given to the server's own ``uvicorn.Config`` as
``http=``; uvicorn itself is untouched) closes a connection whose head does not arrive within
``head_timeout`` s, or whose body does not arrive within ``body_timeout`` s, with a 408. At
``max_connections`` open, a new connection closes the longest-idle one (no request on it: a
half-sent head, or keep-alive between requests); when every one carries a request, the new one
gets a 503 and is closed at once. Idle sockets cannot take the descriptors a real request needs.

What a client that stops reading leaves unsent is bounded (the kernel's send buffer and asyncio's
write buffer), and such a connection cannot linger: the app cuts a stalled stream off through the
request's ``CONNECTION_ABORT_KEY`` (a reset, whatever is queued), and a connection uvicorn closes
with output still queued (a finished response nobody read, at keep-alive's end or at shutdown) is
reset after ``stall_timeout`` s instead of waiting forever for the client to read.

A client that reads, but slower than its stream is produced, is cut off too: once the write
buffer is full (the app's sends wait), it must drain *completely* within ``stall_timeout`` s of
filling, and partial reads do not restart that clock (writing resumes only at an empty buffer).
A client that keeps up never fills it. At the deadline the request's handler registered through
``BACKLOG_WATCH_KEY`` aborts it (its row freed); a connection without one is reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from typing import Any, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvplug_transformers.request_limits import RequestRefused

SEND_BUFFER_BYTES = 64 << 10  # the kernel's send buffer per connection
WRITE_BUFFER_BYTES = 16 << 10  # asyncio's buffer above it: uvicorn pauses the app's sends past this (its default: 64 KiB)
DEFAULT_STALL_TIMEOUT_S = 30.0  # --stream-stall-timeout's default
CONNECTION_ABORT_KEY = "kvplug.abort_connection"  # scope key: resets the request's connection (a stalled stream)
BACKLOG_WATCH_KEY = "kvplug.watch_backlog"  # scope key: registers what to call when the backlog misses its deadline


def raw_refusal(refusal: RequestRefused) -> bytes:
    """A complete HTTP/1.1 response with OpenAI's error body that closes the connection."""
    body = json.dumps(refusal.to_json()).encode()
    reason = {408: b"Request Timeout", 503: b"Service Unavailable"}.get(refusal.status, b"Error")
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        % (refusal.status, reason, len(body))
    )
    return head + body


class GuardedH11Protocol(H11Protocol):
    """Built by uvicorn per connection; the limits come from ``ConnectionLimits``, bound with
    ``ConnectionLimits.protocol()``."""

    limits: Any = None  # a ConnectionLimits, set on the subclass ConnectionLimits.protocol() makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._unsent_deadline: asyncio.TimerHandle | None = None
        self._backlog_deadline: asyncio.TimerHandle | None = None  # armed while the write buffer is full
        self._on_backlog_expired: Callable[[], None] | None = None  # the running request's abort
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limits = self.limits
        if len(self.server_state.connections) >= limits.max_connections:
            limits.close_oldest_idle()  # an idle connection gives way to one that may carry a request
        if len(self.server_state.connections) >= limits.max_connections:
            self._refused = True
            self.transport = transport
            limits.note_refused_connection()
            transport.write(raw_refusal(RequestRefused(
                f"this server holds {limits.max_connections} open connections already (--limit-concurrency); "
                "try again later", status=503,
            )))
            transport.close()
            return
        super().connection_made(transport)
        # unsent output held in this process is bounded, and once full it must drain to empty
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES, low=0)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # ... and in the kernel
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._follow_state()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._follow_state()

    def abort_connection(self) -> None:
        """Reset the connection now, dropping its unsent output: the client reads nothing, so a
        close would wait for it forever. uvicorn then sees the connection lost, which ends the
        request's pending sends and tells the app the client is gone."""
        if self.transport is None:
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset (RST), not a FIN queued behind output the kernel would keep retrying
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def pause_writing(self) -> None:
        """The write buffer is full: the client is not keeping up. Its backlog must be gone within
        ``stall_timeout`` s from now, however much it reads meanwhile."""
        super().pause_writing()
        if self._backlog_deadline is None:
            self._backlog_deadline = self.loop.call_later(self.limits.stall_timeout, self._backlog_expired)

    def resume_writing(self) -> None:
        """The write buffer drained to empty (the low-water mark is 0): the client caught up."""
        super().resume_writing()
        self._cancel_backlog_deadline()

    def watch_backlog(self, on_expired: Callable[[], None]) -> None:
        """``on_expired`` (the running request's abort) replaces the plain reset at the backlog
        deadline, until the response completes."""
        self._on_backlog_expired = on_expired

    def _backlog_expired(self) -> None:
        self._backlog_deadline = None
        self.limits.backlog_timeouts += 1
        on_expired, self._on_backlog_expired = self._on_backlog_expired, None
        if on_expired is not None:
            on_expired()  # resets the connection, then cancels the request
        else:
            self.abort_connection()

    def _cancel_backlog_deadline(self) -> None:
        if self._backlog_deadline is not None:
            self._backlog_deadline.cancel()
            self._backlog_deadline = None

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()
        self._bound_unsent()

    def shutdown(self) -> None:
        super().shutdown()
        self._bound_unsent()

    def _bound_unsent(self) -> None:
        """A transport closed with output still queued waits until the client reads it: reset
        it if that has not happened within ``stall_timeout`` s."""
        if (self._unsent_deadline is None and self.transport.is_closing()
                and self.transport.get_write_buffer_size() > 0):
            self._unsent_deadline = self.loop.call_later(self.limits.stall_timeout, self.abort_connection)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._cancel_backlog_deadline()
        self._on_backlog_expired = None
        if self._unsent_deadline is not None:
            self._unsent_deadline.cancel()
            self._unsent_deadline = None
        self.limits.idle.pop(self, None)
        if self._refused:
            return
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._on_backlog_expired = None  # its request is answered: a later deadline just resets
        super().on_response_complete()
        self._follow_state()

    def _follow_state(self) -> None:
        """Arm the deadline of what the client owes now: a request head, or the rest of a body."""
        if self.cycle is not None:  # the request's app runs from the next loop turn: it finds the key
            self.cycle.scope.setdefault(CONNECTION_ABORT_KEY, self.abort_connection)
            self.cycle.scope.setdefault(BACKLOG_WATCH_KEY, self.watch_backlog)
        state = self.conn.their_state
        if state is h11.IDLE and self.timeout_keep_alive_task is None:
            phase = "head"
        elif state is h11.SEND_BODY:
            phase = "body"
        else:
            phase = None  # the request is read (or keep-alive's own timer watches an idle connection)
        if state is h11.IDLE and self.conn.our_state is h11.IDLE and not self.transport.is_closing():
            self.limits.idle.setdefault(self, None)  # no request on it now: it may be closed for room
        else:
            self.limits.idle.pop(self, None)
        if phase == self._phase:
            return
        self._cancel_deadline()
        self._phase = phase
        if phase is not None:
            timeout = self.limits.head_timeout if phase == "head" else self.limits.body_timeout
            self._deadline = self.loop.call_later(timeout, self._expired, phase, timeout)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, phase: str, timeout: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        self.limits.note_timeout(phase)
        what = "request head (line and headers)" if phase == "head" else "request body"
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self.transport.write(raw_refusal(RequestRefused(
                f"the {what} did not arrive within {timeout:g} s "
                f"({'--timeout-header' if phase == 'head' else '--timeout-body'})", status=408,
            )))
            if cycle is not None:
                cycle.response_started = True
                cycle.response_complete = True  # the app's own answer, if any, is dropped
        self.transport.close()

    def make_room(self) -> None:
        """Closed to let a new connection in: it carried no request."""
        self._cancel_deadline()
        self.limits.idle.pop(self, None)
        self.server_state.connections.discard(self)  # counted out now: connection_lost comes a tick later
        if not self.transport.is_closing():
            self.transport.write(raw_refusal(RequestRefused(
                f"closed: this connection sent no request and the server holds {self.limits.max_connections} "
                "connections (--limit-concurrency)", status=408,
            )))
            self.transport.close()


class ConnectionLimits:
    """What one connection may take: the open-connection cap and the read deadlines, with
    counters of what was refused (``/kvplug/stats`` shows them).

    Args:
        max_connections: open connections at once; one more gets a 503 and is closed.
        head_timeout: seconds a connection may take to send a request's line and headers.
        body_timeout: seconds a request may take to send its body.
        stall_timeout: seconds a closed connection may keep output its client does not read, and
            seconds a full write buffer may take to drain completely (``--stream-stall-timeout``),
            before it is reset.
    """

    def __init__(self, max_connections: int, head_timeout: float, body_timeout: float,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.max_connections = max_connections
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout
        self.stall_timeout = stall_timeout
        self.refused_connections = 0
        self.head_timeouts = 0
        self.body_timeouts = 0
        self.closed_for_room = 0
        self.backlog_timeouts = 0  # connections whose full write buffer did not drain within stall_timeout
        self.idle: dict[GuardedH11Protocol, None] = {}  # open connections with no request on them, oldest first

    def close_oldest_idle(self) -> None:
        """Close the longest-idle connection (one whose request has not fully arrived, or a
        keep-alive one between requests), if any."""
        if self.idle:
            oldest = next(iter(self.idle))
            self.closed_for_room += 1
            oldest.make_room()

    def protocol(self) -> type[GuardedH11Protocol]:
        """A ``GuardedH11Protocol`` subclass bound to these limits (for ``uvicorn.Config(http=...)``)."""
        return type("KVPlugH11Protocol", (GuardedH11Protocol,), {"limits": self})

    def note_refused_connection(self) -> None:
        self.refused_connections += 1

    def note_timeout(self, phase: str) -> None:
        if phase == "head":
            self.head_timeouts += 1
        else:
            self.body_timeouts += 1

    def to_json(self) -> dict:
        return {
            "refused_connections": self.refused_connections, "head_timeouts": self.head_timeouts,
            "body_timeouts": self.body_timeouts, "closed_for_room": self.closed_for_room,
            "backlog_timeouts": self.backlog_timeouts,
        }
