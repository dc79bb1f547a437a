"""``redis``: pages in a Redis server, ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]``.

``exists`` pipelines one EXISTS per key (Redis's multi-key EXISTS counts, it does not say which),
``put`` pipelines one SET per page so that a full server (``OOM`` under ``noeviction``) drops only
the pages it refuses, ``get`` is one MGET. Option ``timeout`` (seconds, default 1.0) bounds each
connect and each socket read or write.
"""

from __future__ import annotations

from typing import Optional, Sequence
from urllib.parse import unquote, urlsplit

from kvplug.interface.errors import InvalidArgumentError, KVStoreError
from kvplug.interface.kv_store import BaseKVStore, KVStoreConfig, check_batch
from kvplug.kv_store.resp import ErrorReply, RespConnection

DEFAULT_PORT = 6379
DEFAULT_TIMEOUT_S = 1.0


class RedisKVStore(BaseKVStore):
    def __init__(self, config: KVStoreConfig) -> None:
        where = config.redacted_url
        try:
            parts = urlsplit(config.url)
            host, port = parts.hostname, parts.port or DEFAULT_PORT
        except ValueError as error:
            raise InvalidArgumentError(f"bad Redis URL {where!r}: {error}") from None
        if parts.scheme.lower() != "redis" or not host:
            raise InvalidArgumentError(f"expected 'redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]', got {where!r}")
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise InvalidArgumentError(f"the Redis database is a number (redis://HOST:PORT/0), got {path!r} in {where!r}")
        timeout = config.options.get("timeout", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
        password = unquote(parts.password) if parts.password is not None else None
        username = unquote(parts.username) if parts.username else None
        self._where = where
        self._connection = RespConnection(
            host, port, timeout=float(timeout), db=int(path or 0), username=username, password=password, where=where
        )

    def exists(self, keys: Sequence[str]) -> int:
        check_batch(keys)
        replies = self._connection.pipeline([[b"EXISTS", key.encode()] for key in keys])
        count = 0
        for reply in replies:
            if isinstance(reply, ErrorReply):
                raise self._error("EXISTS", reply)
            if reply != 1:
                break
            count += 1
        return count

    def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> int:
        check_batch(keys, pages)
        replies = self._connection.pipeline([[b"SET", key.encode(), page] for key, page in zip(keys, pages)])
        stored = 0
        for reply in replies:
            if isinstance(reply, ErrorReply):
                if reply.startswith("OOM"):
                    return stored  # full: the rest is dropped, which the caller counts
                raise self._error("SET", reply)
            stored += 1
        return stored

    def get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        check_batch(keys)
        if not keys:
            return []
        (reply,) = self._connection.pipeline([[b"MGET", *(key.encode() for key in keys)]])
        if isinstance(reply, ErrorReply):
            raise self._error("MGET", reply)
        if not isinstance(reply, list) or len(reply) != len(keys):
            raise KVStoreError(f"{self._where} answered MGET of {len(keys)} keys with {type(reply).__name__}", reason="protocol")
        return reply

    def close(self) -> None:
        self._connection.close()

    def describe(self) -> str:
        return self._where

    def __repr__(self) -> str:
        return f"RedisKVStore({self._where!r})"

    def _error(self, command: str, reply: str) -> KVStoreError:
        reason = "auth" if reply.startswith(("NOAUTH", "WRONGPASS")) else "protocol"
        return KVStoreError(f"{self._where} refused {command}: {reply[:200]}", reason=reason)
