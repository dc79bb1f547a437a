"""``RemoteKV``: the serving path's face of a shared KV store; every store fault is a counted miss.

It keys pages by the prompt (``keys.page_keys``), checksums what it writes and checks what it
reads (``framing``), and checks the store's answers (a wrong-length or out-of-range answer is a
fault of the store, like an exception). Nothing a store does raises out of ``lookup`` / ``load`` /
``store``: a store that is down, slow or refuses the credentials is skipped for ``retry_after_s``
(so a dead server costs one timeout per interval, not one per request), a full one drops writes,
a corrupt value is a miss; all are counted in ``stats``. A page is loaded only if its value is
intact and its key's, so the worst a store can do is cost a recompute.

Threads: a store writer (``prefix_cache.store_writer``) calls ``store_pages`` off the serving
thread while the serving thread reads, and a store reader (``prefix_cache.store_reader``) calls
``lookup_keys`` / ``load_keys`` off it too (reads take one lock: one read at a time). Counters have their own lock, never held across a store
call, so ``stats`` (read every step) never waits for the network; with ``write_store`` (a second
connection to the same store) writes do not queue behind reads either, nor reads behind writes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Sequence

from kvplug.interface.errors import InvalidArgumentError, KVStoreError
from kvplug.interface.kv_store import BaseKVStore
from kvplug.kv_store.framing import frame, unframe
from kvplug.kv_store.keys import KVNamespace, page_keys

logger = logging.getLogger("kvplug.kv_store")

DEFAULT_RETRY_AFTER_S = 2.0
_BACKS_OFF = ("unavailable", "timeout", "auth")
_FAILED = object()  # what _call returns for a failed put (0 would read as "the store was full")


@dataclass(frozen=True)
class RemoteKVStats:
    """Counters since the ``RemoteKV`` was built.

    Attributes:
        lookups, lookup_hit_pages: ``lookup`` calls, and pages they found stored.
        loads, loaded_pages, loaded_bytes: ``load`` calls and the intact pages they returned.
        missing_pages: pages a lookup found but the load did not get (evicted meanwhile).
        corrupt_pages: values that failed the checksum or the key check: not loaded.
        stores, written_pages, written_bytes: ``store`` calls and the pages the store kept.
        dropped_pages: pages a ``store`` call did not get into the store (full, or a fault).
        errors_unavailable, errors_timeout, errors_full, errors_auth, errors_protocol: store faults
            by reason (``KVStoreError.reason``); errors_other: a store that raised anything else
            or answered out of contract.
        skipped_calls: calls not sent because the store failed less than ``retry_after_s`` ago.
        queued_pages: pages handed to a store writer (``count_write_queued``); once it is flushed,
            ``queued_pages == written_pages + dropped_pages + unwritten_pages`` for its writes.
        unwritten_pages: pages a store writer dropped before any ``store`` call: its queue was
            full or closed, or their device -> host copy failed (``count_unwritten``).
    """

    lookups: int = 0
    lookup_hit_pages: int = 0
    loads: int = 0
    loaded_pages: int = 0
    loaded_bytes: int = 0
    missing_pages: int = 0
    corrupt_pages: int = 0
    stores: int = 0
    written_pages: int = 0
    written_bytes: int = 0
    dropped_pages: int = 0
    errors_unavailable: int = 0
    errors_timeout: int = 0
    errors_full: int = 0
    errors_auth: int = 0
    errors_protocol: int = 0
    errors_other: int = 0
    skipped_calls: int = 0
    queued_pages: int = 0
    unwritten_pages: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class RemoteKV:
    """Pages of one namespace in one store.

    Args:
        store: the store (a ``kvplug.BaseKVStore``); ``RemoteKV`` owns its connection from now on.
        namespace: what a stored page must match to load here.
        retry_after_s: after a store is found down, slow or refusing, skip it this long.
        clock: monotonic seconds (a test passes its own).
        write_store: a second connection to the same store for ``store_pages`` (owned as
            ``store`` is); default: ``store`` (one call at a time over both, unless the store
            allows ``concurrent_calls``).
    """

    def __init__(
        self,
        store: BaseKVStore,
        namespace: KVNamespace,
        *,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        write_store: Optional[BaseKVStore] = None,
    ) -> None:
        if not isinstance(store, BaseKVStore):
            raise InvalidArgumentError(f"store must be a kvplug.BaseKVStore, got {type(store).__name__}")
        if write_store is not None and not isinstance(write_store, BaseKVStore):
            raise InvalidArgumentError(f"write_store must be a kvplug.BaseKVStore, got {type(write_store).__name__}")
        if not isinstance(namespace, KVNamespace):
            raise InvalidArgumentError(f"namespace must be a kvplug.kv_store.KVNamespace, got {type(namespace).__name__}")
        self.store = store
        self.namespace = namespace
        self._retry_after_s = float(retry_after_s)
        self._clock = clock
        self._down_until: Optional[float] = None
        self._counts = {field.name: 0 for field in fields(RemoteKVStats)}
        self._counts_lock = threading.Lock()  # counters and the back-off; never held across a store call
        self._lock = threading.Lock()  # one call at a time: a store's connection is not shared
        self.write_store = write_store if write_store is not None else store
        separate = write_store is not None or store.concurrent_calls
        self._write_lock = threading.Lock() if separate else self._lock

    @property
    def page_size(self) -> int:
        return self.namespace.page_size

    @property
    def stats(self) -> RemoteKVStats:
        with self._counts_lock:
            return RemoteKVStats(**self._counts)

    def count_write_queued(self, pages: int) -> None:
        """A store writer was handed ``pages`` pages (it writes them, or counts them unwritten)."""
        self._add(queued_pages=pages)

    def count_unwritten(self, pages: int) -> None:
        """A store writer dropped ``pages`` pages without a store call (see ``unwritten_pages``)."""
        self._add(unwritten_pages=pages)

    def _add(self, **deltas: int) -> None:
        with self._counts_lock:
            counts = self._counts
            for name, delta in deltas.items():
                counts[name] += delta

    def keys(self, token_ids: Sequence[int]) -> tuple[str, ...]:
        return page_keys(self.namespace, token_ids)

    def lookup(self, token_ids: Sequence[int], start_page: int = 0) -> int:
        """How many whole pages of ``token_ids``, from page ``start_page`` on, the store holds."""
        return self.lookup_keys(self.keys(token_ids)[_checked_start(start_page) :])

    def lookup_keys(self, keys: Sequence[str]) -> int:
        """``lookup`` of keys computed already (``keys``): how many of them, from the first, are stored."""
        self._add(lookups=1)
        if not keys:
            return 0
        with self._lock:
            found = self._call("exists", lambda: self.store.exists(keys), 0, self.store)
        if isinstance(found, bool) or not isinstance(found, int) or not 0 <= found <= len(keys):
            self._out_of_contract("exists", f"returned {found!r} for {len(keys)} keys", self.store)
            return 0
        self._add(lookup_hit_pages=found)
        return found

    def load(self, token_ids: Sequence[int], start_page: int, num_pages: int) -> list[memoryview]:
        """The intact payloads of pages ``start_page .. start_page + num_pages``, up to the first
        one missing or corrupt (a prefix of what was asked; maybe empty)."""
        return self.load_keys(self.keys(token_ids)[_checked_start(start_page) :][: max(0, int(num_pages))])

    def load_keys(self, keys: Sequence[str]) -> list[memoryview]:
        """``load`` of keys computed already: the intact payloads of ``keys``' pages, up to the
        first one missing or corrupt (a store reader computes keys on another thread than the get's)."""
        self._add(loads=1)
        if not keys:
            return []
        with self._lock:
            values = self._call("get", lambda: self.store.get(keys), None, self.store)
        if values is None:
            return []
        if not isinstance(values, list) or len(values) != len(keys):
            self._out_of_contract("get", f"returned {type(values).__name__} for {len(keys)} keys", self.store)
            return []
        payloads = []
        for key, value in zip(keys, values):
            if value is None:
                self._add(missing_pages=1)
                break
            payload = unframe(key, value)
            if payload is None:
                self._add(corrupt_pages=1)
                logger.warning("kvplug remote KV: a corrupt page value in %s was not loaded", self.store.describe())
                break
            payloads.append(payload)
        self._add(loaded_pages=len(payloads), loaded_bytes=sum(len(payload) for payload in payloads))
        return payloads

    def store_pages(self, token_ids: Sequence[int], pages: Sequence[Any], start_page: int = 0) -> int:
        """Write ``pages`` (bytes-like payloads) as pages ``start_page ..`` of ``token_ids``; how
        many, from the first, the store kept (the rest are dropped, counted)."""
        keys = self.keys(token_ids)[_checked_start(start_page) :]
        if len(pages) > len(keys):
            raise InvalidArgumentError(
                f"{len(pages)} pages from page {start_page} but the prompt has only {len(keys)} whole pages there"
            )
        for index, page in enumerate(pages):
            if not isinstance(page, (bytes, bytearray, memoryview)) or len(page) == 0:
                raise InvalidArgumentError(f"page {index} must be non-empty bytes-like, got {type(page).__name__}")
        keys = keys[: len(pages)]
        values = [frame(key, page) for key, page in zip(keys, pages)]
        self._add(stores=1)
        if not keys:
            return 0
        store = self.write_store
        with self._write_lock:
            stored = self._call("put", lambda: store.put(keys, values), _FAILED, store)
        full = 0
        if stored is _FAILED:
            stored = 0
        elif isinstance(stored, bool) or not isinstance(stored, int) or not 0 <= stored <= len(keys):
            self._out_of_contract("put", f"returned {stored!r} for {len(keys)} pages", store)
            stored = 0
        elif stored < len(keys):
            full = 1  # the store kept fewer than it was given: full
        self._add(errors_full=full, dropped_pages=len(keys) - stored, written_pages=stored,
                  written_bytes=sum(len(page) for page in pages[:stored]))
        return stored

    def close(self) -> None:
        for store, lock in dict.fromkeys([(self.store, self._lock), (self.write_store, self._write_lock)]):
            with lock:
                try:
                    store.close()
                except Exception:  # closing a broken connection must not fail a shutdown
                    logger.warning("kvplug remote KV: closing %s failed", store.describe(), exc_info=True)

    def _call(self, operation: str, call: Callable[[], Any], default: Any, store: BaseKVStore) -> Any:
        now = self._clock()
        with self._counts_lock:
            if self._down_until is not None:
                if now < self._down_until:
                    self._counts["skipped_calls"] += 1
                    return default
                self._down_until = None
        try:
            return call()
        except KVStoreError as error:
            with self._counts_lock:
                self._counts[f"errors_{error.reason}"] += 1
                if error.reason in _BACKS_OFF:
                    self._down_until = now + self._retry_after_s
            if error.reason in _BACKS_OFF:
                logger.warning(
                    "kvplug remote KV: %s failed (%s); serving without it for %.1f s", operation, error, self._retry_after_s
                )
            return default
        except Exception as error:  # a store plugin's bug costs a recompute, never a request
            self._add(errors_other=1)
            logger.warning(
                "kvplug remote KV: store %s raised %s in %s; treated as a miss",
                store.describe(), type(error).__name__, operation,
            )
            return default

    def _out_of_contract(self, operation: str, what: str, store: BaseKVStore) -> None:
        self._add(errors_other=1)
        logger.warning("kvplug remote KV: store %s %s %s; treated as a miss", store.describe(), operation, what)


def open_remote_kv(url: str, namespace: KVNamespace, *, manager: Any = None, retry_after_s: float = DEFAULT_RETRY_AFTER_S,
                   **options: Any) -> RemoteKV:
    """A ``RemoteKV`` over the store ``url`` names (its scheme is the store's registered name)."""
    from kvplug.plugins import default_manager

    store = (manager or default_manager()).create_kv_store(url, **options)
    return RemoteKV(store, namespace, retry_after_s=retry_after_s)


def _checked_start(start_page: int) -> int:
    if isinstance(start_page, bool) or not isinstance(start_page, int) or start_page < 0:
        raise InvalidArgumentError(f"start_page must be an int >= 0, got {start_page!r}")
    return start_page
