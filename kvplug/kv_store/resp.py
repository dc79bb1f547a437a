"""A minimal RESP2 client (Redis's wire protocol) over one TCP connection, standard library only.

kvplug needs six commands (AUTH, SELECT, PING, EXISTS, SET, MGET), pipelined; owning the socket
keeps the timeouts and what an error message says (never the password) in kvplug's hands, with
no dependency to install. Every failure raises ``KVStoreError`` and closes the connection (its
state is unknown after a timeout); the next call connects again.
"""

from __future__ import annotations

import socket
from typing import Optional, Sequence, Union

from kvplug.interface.errors import KVStoreError

Reply = Union[None, int, bytes, str, list, "ErrorReply"]


class ErrorReply(str):
    """A ``-ERR ...`` reply: returned in a pipeline's results, so one failed command does not hide the others."""


class RespConnection:
    """One connection to a Redis server; ``where`` names it in errors (no credential in it)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float,
        db: int = 0,
        username: Optional[str] = None,
        password: Optional[str] = None,
        where: str = "",
    ) -> None:
        self._address = (host, port)
        self._timeout = timeout
        self._db = db
        self._username = username
        self._password = password
        self._where = where or f"redis at {host}:{port}"
        self._sock: Optional[socket.socket] = None
        self._reader = None

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self._reader = None

    def pipeline(self, commands: Sequence[Sequence[bytes]]) -> list[Reply]:
        """Send every command, then read every reply, in order."""
        if not commands:
            return []
        self._ensure_connected()
        try:
            self._sock.sendall(b"".join(_encode(command) for command in commands))
            return [self._read_reply() for _ in commands]
        except BaseException as error:
            self.close()
            raise _as_store_error(error, self._where) from None

    def _ensure_connected(self) -> None:
        if self._sock is not None:
            return
        try:
            sock = socket.create_connection(self._address, timeout=self._timeout)
        except OSError as error:
            raise _as_store_error(error, self._where) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._reader = sock, sock.makefile("rb")
        setup = []
        if self._password is not None:
            auth = [b"AUTH"] + ([self._username.encode()] if self._username else []) + [self._password.encode()]
            setup.append(auth)
        if self._db:
            setup.append([b"SELECT", str(self._db).encode()])
        try:
            self._sock.sendall(b"".join(_encode(command) for command in setup))
            replies = [self._read_reply() for _ in setup]
        except BaseException as error:
            self.close()
            raise _as_store_error(error, self._where) from None
        for reply in replies:
            if isinstance(reply, ErrorReply):
                self.close()
                reason = "auth" if reply.startswith(("WRONGPASS", "NOAUTH", "ERR AUTH", "ERR invalid password")) else "protocol"
                # the server's words never repeat the password; ours do not hold it either
                raise KVStoreError(f"{self._where} refused the connection setup: {reply[:200]}", reason=reason)

    def _read_reply(self) -> Reply:
        line = self._reader.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("the server closed the connection")
        kind, body = line[:1], line[1:-2]
        if kind == b"+":
            return body.decode("utf-8", "replace")
        if kind == b"-":
            return ErrorReply(body.decode("utf-8", "replace"))
        if kind == b":":
            return int(body)
        if kind == b"$":
            length = int(body)
            if length < 0:
                return None
            data = self._reader.read(length + 2)
            if len(data) != length + 2:
                raise ConnectionError("the server closed the connection inside a reply")
            return data[:-2]
        if kind == b"*":
            count = int(body)
            return None if count < 0 else [self._read_reply() for _ in range(count)]
        raise _ProtocolError(f"unexpected RESP reply type {kind!r}")


class _ProtocolError(Exception):
    pass


def _encode(command: Sequence[bytes]) -> bytes:
    parts = [b"*%d\r\n" % len(command)]
    for argument in command:
        parts.append(b"$%d\r\n" % len(argument))
        parts.append(bytes(argument))
        parts.append(b"\r\n")
    return b"".join(parts)


def _as_store_error(error: BaseException, where: str) -> BaseException:
    if isinstance(error, KVStoreError) or not isinstance(error, Exception):
        return error  # KeyboardInterrupt and friends pass through unchanged
    if isinstance(error, (socket.timeout, TimeoutError)):
        return KVStoreError(f"{where} did not answer in time", reason="timeout")
    if isinstance(error, OSError):
        return KVStoreError(f"{where} is unreachable: {type(error).__name__}: {error.strerror or error}", reason="unavailable")
    if isinstance(error, (_ProtocolError, ValueError)):
        return KVStoreError(f"{where} sent a reply kvplug cannot parse: {error}", reason="protocol")
    return KVStoreError(f"{where} failed: {type(error).__name__}", reason="protocol")
