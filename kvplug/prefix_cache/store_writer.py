"""``StoreWriter``: the host tier's writes to the shared KV store, off the serving thread (issue 30).

Why a thread: on CUDA the device -> host copy of an evicted prefix is still under way when
``evict`` returns (``HostKVPool.write`` queues it), so its bytes can be stored only after the
device has run it; the serving thread never waits for the device, nor for the store's network.
``submit`` hands one node's write (``StoreWrite``: its pages' keys, as the prompt tokens and the
first page, the write's ticket, and its host pages pinned) to the writer and returns at once. The
writer thread, in submission order, waits until the copy has landed (``HostKVPool.wait_written``:
the event the copy worker recorded after the copy's last chunk, waited on here), reads the pinned
pages, writes them (``RemoteKV.store_pages``: checksums, the put, the counters) and releases the
pin; the tier then may reuse the pages (``HostPagePins``).

Bounded: at most ``max_queued`` writes wait; one more is dropped at once (counted
``unwritten_pages``, its pin released): a slow or dead store costs the fleet those prefixes,
never the serving thread a wait. A copy that failed (``TierCopyError`` from ``wait_written``) is
not written (its bytes are not trustworthy) and counted the same way. ``flush`` waits until
everything submitted is done (tests, benchmarks); ``close`` drains within a bound and drops the
rest, counted. A cache dropped with writes queued ``detach``es its writer (no wait: the worker
finishes the queue and ends), and the interpreter's exit waits for live writers at most
``DEFAULT_CLOSE_S`` in all.

``threaded=False`` writes in ``submit`` itself, on the caller's thread: the CPU pools' default,
where the copy is done when ``evict`` returns and writes are visible to the next call (tests and
the serve process's stats stay deterministic); the store's latency is then on the serving thread.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from typing import NamedTuple, Optional

import numpy as np

from kvplug.interface import TierCopyError
from kvplug.kv_store.host_pages import host_page_views
from kvplug.kv_store.remote import RemoteKV
from kvplug.prefix_cache.host_pins import PinnedHostPages

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CLOSE_S", "DEFAULT_MAX_QUEUED", "StoreWrite", "StoreWriter"]

#: Writes (evicted nodes) that may wait for the writer; their pages stay pinned meanwhile.
DEFAULT_MAX_QUEUED = 256
#: How long ``close`` (and the interpreter's exit) waits for queued writes before dropping them: short,
#: because a server's stop is bounded (``--shutdown-timeout``).
DEFAULT_CLOSE_S = 1.0


class StoreWrite(NamedTuple):
    """One node's pages to write to the store.

    Attributes:
        token_ids: shape ``[t]``, int32, host; the prompt through the node's last page (the keys).
        start_page: the node's first page in ``token_ids``.
        pins: the node's host pages, in page order, pinned until the writer releases them.
        ticket: the ``HostKVPool.write`` ticket of the copy that fills them (``None``: landed).
    """

    token_ids: np.ndarray
    start_page: int
    pins: PinnedHostPages
    ticket: Optional[int]


class StoreWriter:
    """Writes ``StoreWrite``s to one ``RemoteKV`` from one host pool's pinned pages (see above).

    Args:
        remote: where pages go (it counts what the store kept and dropped).
        host_pool: the ``HostKVPool`` the pages are in.
        threaded: write on a worker thread (CUDA pools) or in ``submit`` (CPU pools).
        max_queued: writes that may wait for the worker; more are dropped, counted.
    """

    def __init__(self, remote: RemoteKV, host_pool, *, threaded: bool, max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        self.remote = remote
        self.host_pool = host_pool
        self.threaded = threaded
        self.max_queued = int(max_queued)
        self._queue: collections.deque[StoreWrite] = collections.deque()
        self._condition = threading.Condition()
        self._busy = False  # the worker is writing one it took off the queue
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        _LIVE.add(self)

    @property
    def queued(self) -> int:
        """Writes waiting for the worker (not counting one it is writing)."""
        with self._condition:
            return len(self._queue)

    def submit(self, write: StoreWrite) -> bool:
        """Hand ``write`` over; never waits (threaded). ``False``: dropped, the queue was full or closed."""
        self.remote.count_write_queued(len(write.pins.pages))  # written, dropped or unwritten later: all counted
        if not self.threaded:
            if self._closed:
                return self._drop(write, "the writer is closed")
            self._write(write)
            return True
        with self._condition:
            refused = "the writer is closed" if self._closed else (
                f"{len(self._queue)} writes queued (max_queued={self.max_queued})"
                if len(self._queue) >= self.max_queued else None)
            if refused is None:
                self._queue.append(write)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="kvplug-store-writer", daemon=True)
                    self._thread.start()
                self._condition.notify_all()
        if refused is not None:
            return self._drop(write, refused)
        return True

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until every write submitted so far is done (written, dropped or failed); ``False``
        when ``timeout_s`` passed first. Not for the serving thread: it waits for the device and the store."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._condition:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._condition.wait(left)
        return True

    def close(self, timeout_s: float = DEFAULT_CLOSE_S) -> bool:
        """Refuse new writes, let the queued ones finish for up to ``timeout_s``, drop the rest
        (counted); ``True`` when everything was written."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            self._closed = True
            self._condition.notify_all()
            thread = self._thread
        drained = self.flush(timeout_s)
        with self._condition:
            left = list(self._queue)
            self._queue.clear()
            self._condition.notify_all()
        for write in left:
            self._drop(write, "closed before it was written")
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))  # ended, unless a store call outlasts the bound
        return drained and not left

    def detach(self) -> None:
        """Refuse new writes and return at once; the worker finishes what is queued, then ends
        (its owner, a cache, is being dropped: never a wait there)."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    # ------------------------------------------------------------------ the worker
    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._closed:
                    self._condition.wait()
                if not self._queue:
                    return
                write = self._queue.popleft()
                self._busy = True
            try:
                self._write(write)
            finally:
                with self._condition:
                    self._busy = False
                    self._condition.notify_all()

    def _write(self, write: StoreWrite) -> None:
        """Wait for the copy, store the pages, release the pin; nothing raises out of here."""
        try:
            self.host_pool.wait_written(write.ticket)
        except TierCopyError as error:
            self.remote.count_unwritten(len(write.pins.pages))
            logger.warning("kvplug store writer: not writing %d pages: %s", len(write.pins.pages), error)
            write.pins.release()
            return
        try:
            self.remote.store_pages(write.token_ids, host_page_views(self.host_pool, write.pins.pages), write.start_page)
        except Exception:  # RemoteKV counts store faults; anything else is a bug that must not stop the writer
            self.remote.count_unwritten(len(write.pins.pages))
            logger.exception("kvplug store writer: writing %d pages failed", len(write.pins.pages))
        finally:
            write.pins.release()

    def _drop(self, write: StoreWrite, why: str) -> bool:
        self.remote.count_unwritten(len(write.pins.pages))
        logger.debug("kvplug store writer: dropped a write of %d pages: %s", len(write.pins.pages), why)
        write.pins.release()
        return False


_LIVE: "weakref.WeakSet[StoreWriter]" = weakref.WeakSet()  # writers whose thread may hold queued writes


@atexit.register
def _drain_live_writers() -> None:
    """At exit: give the live writers' queued writes ``DEFAULT_CLOSE_S`` in all, then drop them."""
    deadline = time.monotonic() + DEFAULT_CLOSE_S
    for writer in list(_LIVE):
        writer.close(max(0.0, deadline - time.monotonic()))
