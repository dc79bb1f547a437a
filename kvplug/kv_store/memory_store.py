"""``memory``: the in-process reference store (one process only; the conformance kit's model).

``memory://NAME`` stores sharing a ``registry`` dict (``options["registry"]``) share their pages,
which lets tests stand two backends on one store without a server. ``capacity_bytes`` bounds it:
a page that does not fit is dropped, as a full remote store drops it.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

from kvplug.interface.errors import InvalidArgumentError
from kvplug.interface.kv_store import BaseKVStore, KVStoreConfig, check_batch


class InMemoryKVStore(BaseKVStore):
    concurrent_calls = True  # every call holds the table's lock

    def __init__(self, config: KVStoreConfig) -> None:
        capacity = config.options.get("capacity_bytes")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
            raise InvalidArgumentError(f"capacity_bytes must be a non-negative int or None, got {capacity!r}")
        registry = config.options.get("registry")
        if registry is not None and not isinstance(registry, dict):
            raise InvalidArgumentError(f"registry must be a dict shared by the stores, got {type(registry).__name__}")
        self._name = config.url.split("://", 1)[1]
        # name -> (pages, lock, bytes used): stores of one registry and name share one table
        shared = registry.setdefault(self._name, ({}, threading.Lock(), [0])) if registry is not None else None
        self._pages, self._lock, self._used = shared or ({}, threading.Lock(), [0])
        self._capacity = capacity

    def exists(self, keys: Sequence[str]) -> int:
        check_batch(keys)
        with self._lock:
            count = 0
            for key in keys:
                if key not in self._pages:
                    break
                count += 1
            return count

    def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> int:
        check_batch(keys, pages)
        with self._lock:
            for stored, (key, page) in enumerate(zip(keys, pages)):
                grow = len(page) - len(self._pages.get(key, b""))
                if self._capacity is not None and self._used[0] + grow > self._capacity:
                    return stored
                self._pages[key] = bytes(page)
                self._used[0] += grow
            return len(keys)

    def get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        check_batch(keys)
        with self._lock:
            return [self._pages.get(key) for key in keys]

    def describe(self) -> str:
        return f"memory://{self._name}"
