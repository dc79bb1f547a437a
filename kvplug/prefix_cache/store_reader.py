"""``StoreReader``: the shared KV store's reads for queued prompts, off the serving thread (issue 30).

Why a thread: the store's ``exists`` and ``get`` are network round trips (an 8k-token context of
the embedded model is 32 MiB: hundreds of milliseconds through Redis on the CPU machine,
BENCHMARKS.md), and the serving thread, which admits requests, drives every running request's
steps. SGLang's HiCache prefetches from its storage tier when a request is queued; so does this:
a host calls ``prefetch(input_ids)`` (``KVBackend.prefetch``) when a request enters its queue,
before its scheduler admits it, and the admission then finds the pages staged in host memory.

``submit`` runs on the caller's thread (an HTTP thread may call it): it computes the prompt's
chained page keys (host data only; it never touches the tree, which belongs to the serving
thread) and queues a ``_Prefetch``. The reader thread, in submission order, looks the keys up
and gets the pages found (``RemoteKV.lookup_keys`` / ``load_keys``: checksums checked, faults
counted there) and stages their payloads. At admission the serving thread ``take``s the
prompt's prefetch: a finished one hands over its payloads (the tier copies them into host pages,
``RemoteTierLink.fetch``), one still running is waited for at most ``timeout_s`` and is a miss
after that (it is dropped when it ends), none is ``NONE`` (the caller decides what that means).

Bounded: at most ``max_records`` prefetches are kept (queued, running or staged; the oldest is
dropped for a new one) and at most ``max_staged_bytes`` of payloads are staged (the oldest staged
prefetch is dropped first, then the newest is cut to what fits); a prefetch is dropped when
taken, so staged bytes never outlive their admission. Every drop is counted (``dropped``).

Pages the server already holds: the reader does not know the tree, so it would fetch a shared
context again for every prompt that reuses it. Each ``take`` tells the reader the key of the last
page the admission then holds (``note_local``, a bounded set); a prefetch whose keys reach one of
those starts after it. The hint may be stale (the pages were dropped since): then the staged pages
start past what the admission needs and the prefetch is not used (``NONE``: the caller's path).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from kvplug.kv_store.remote import RemoteKV

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_RECORDS",
    "DEFAULT_TIMEOUT_S",
    "NONE",
    "READY",
    "TIMED_OUT",
    "StoreReader",
    "StoreReaderStats",
    "Taken",
]

#: Prefetches kept at once (queued, running or staged).
DEFAULT_MAX_RECORDS = 256
#: How long an admission waits for its prefetch still running before it is a miss.
DEFAULT_TIMEOUT_S = 0.5
#: Keys of pages admissions hold, remembered so a prefetch does not fetch them again.
_LOCAL_KEYS = 4096

NONE, READY, TIMED_OUT = "none", "ready", "timed_out"


class Taken(NamedTuple):
    """What ``take`` found for one admission.

    Attributes:
        status: ``READY`` (a finished prefetch; ``payloads`` may be empty: the store had nothing
            more), ``TIMED_OUT`` (still running after the wait: a miss) or ``NONE`` (no prefetch of
            this prompt, or one whose pages start past ``start_page``).
        payloads: intact page payloads from page ``start_page`` on, in order.
    """

    status: str
    payloads: tuple = ()


@dataclass(frozen=True)
class StoreReaderStats:
    """Counters since the reader was built.

    Attributes:
        prefetches: prompts handed to ``submit`` and queued (``coalesced`` ones not included).
        coalesced: ``submit`` calls for a prompt already queued or staged (nothing new queued).
        staged_pages, staged_bytes: pages (and their bytes) staged now.
        taken_pages: staged pages admissions took.
        waits: admissions that waited for a prefetch still running; timeouts: of those, the ones
            it was still running after ``timeout_s`` (a miss).
        dropped: prefetches dropped before an admission took them: the oldest, for a new one or
            for staged bytes; one whose admission timed out; one the reader failed on.
        skipped_local_pages: leading pages not fetched because an admission held them.
        errors: prefetches the reader failed on (not a store fault, which ``RemoteKV`` counts as a miss).
    """

    prefetches: int = 0
    coalesced: int = 0
    staged_pages: int = 0
    staged_bytes: int = 0
    taken_pages: int = 0
    waits: int = 0
    timeouts: int = 0
    dropped: int = 0
    skipped_local_pages: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class _Prefetch:
    """One prompt's prefetch; its fields change under the reader's lock only."""

    __slots__ = ("keys", "names", "start", "payloads", "nbytes", "done", "state")

    def __init__(self, keys: tuple[str, ...], names: tuple[bytes, ...]) -> None:
        self.keys = keys  # the prompt's page keys, page 0 on
        self.names = names  # its index entries (the prompt's whole pages, with and without the last token)
        self.start = 0  # the first page fetched
        self.payloads: tuple = ()
        self.nbytes = 0
        self.done = threading.Event()
        self.state = "queued"  # queued -> running -> staged; dropped at any point


class StoreReader:
    """Prefetches pages of ``RemoteKV`` for queued prompts (see the module docstring).

    Args:
        remote: the store (it counts the lookups, the pages loaded and the faults).
        page_bytes: bytes of one page (the host pool's), to bound what is staged.
        max_staged_bytes: payload bytes staged at once.
        max_records: prefetches kept at once.
    """

    def __init__(
        self, remote: RemoteKV, page_bytes: int, *, max_staged_bytes: int, max_records: int = DEFAULT_MAX_RECORDS
    ) -> None:
        self.remote = remote
        self.page_size = remote.page_size
        self.page_bytes = max(1, int(page_bytes))
        self.max_staged_bytes = int(max_staged_bytes)
        self.max_records = max(1, int(max_records))
        self._condition = threading.Condition()
        self._queue: collections.deque[_Prefetch] = collections.deque()
        self._records: dict[_Prefetch, None] = {}  # live prefetches, oldest first
        self._index: dict[bytes, _Prefetch] = {}
        self._local: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._busy = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._counts = {name: 0 for name in StoreReaderStats.__dataclass_fields__}

    @property
    def stats(self) -> StoreReaderStats:
        with self._condition:
            return StoreReaderStats(**self._counts)

    # ------------------------------------------------------------------ any thread
    def submit(self, token_ids: np.ndarray) -> bool:
        """Queue a prefetch of ``token_ids`` (shape ``[n]``, int32, host: the prompt as it will be
        admitted); returns at once. ``False``: nothing queued (no whole page, closed, or coalesced)."""
        page_size = self.page_size
        n = int(token_ids.shape[0])
        whole = n - n % page_size
        if whole == 0:
            return False
        keys = self.remote.keys(token_ids[:whole])  # the hashing: on the caller's thread
        names = (token_ids[:whole].tobytes(),)
        shorter = (n - 1) - (n - 1) % page_size  # admission matches at most n - 1 tokens (allocator)
        if 0 < shorter < whole:
            names += (token_ids[:shorter].tobytes(),)
        record = _Prefetch(keys, names)
        with self._condition:
            if self._closed:
                return False
            if names[0] in self._index:
                self._counts["coalesced"] += 1
                return False
            while len(self._records) >= self.max_records:
                self._drop(next(iter(self._records)))
            for name in names:
                self._index[name] = record
            self._records[record] = None
            self._queue.append(record)
            self._counts["prefetches"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvplug-store-reader", daemon=True)
                self._thread.start()
            self._condition.notify_all()
        return True

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until every prefetch submitted so far is staged or dropped; ``False`` when
        ``timeout_s`` passed first (tests, benchmarks: not for the serving thread)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._condition:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._condition.wait(left)
        return True

    def close(self) -> None:
        """Drop every prefetch (counted) and end the reader thread once its store call returns."""
        with self._condition:
            self._closed = True
            for record in list(self._records):
                self._drop(record)
            self._condition.notify_all()

    # ------------------------------------------------------------------ the serving thread
    def take(self, token_ids: np.ndarray, start_page: int, timeout_s: float) -> Taken:
        """The staged pages of ``token_ids`` (its whole pages, as the admission matches them) from
        ``start_page`` on; waits at most ``timeout_s`` for a prefetch still running. The prefetch is
        dropped (its bytes freed) whatever the answer."""
        if not self._index:  # no prefetch kept: the usual case of a host that never prefetches
            return Taken(NONE)
        name = token_ids.tobytes()
        with self._condition:
            record = self._index.get(name)
            if record is None:
                return Taken(NONE)
            if not record.done.is_set():
                self._counts["waits"] += 1
        if not record.done.is_set() and not record.done.wait(max(0.0, timeout_s)):
            with self._condition:
                self._counts["timeouts"] += 1
                if record in self._records:
                    self._drop(record)
            return Taken(TIMED_OUT)
        with self._condition:
            if record.state != "staged":  # dropped meanwhile (for a newer one, or by close)
                return Taken(NONE)
            self._forget(record)
            record.state = "taken"
            if not record.start <= start_page:
                return Taken(NONE)  # a stale hint: the pages before record.start are not held now
            # the prompt may have been prefetched a page longer than the admission matches (its last token)
            end = token_ids.shape[0] // self.page_size
            payloads = record.payloads[start_page - record.start : max(0, end - record.start)]
            self._counts["taken_pages"] += len(payloads)
            held = start_page + len(payloads)
            if held:
                self._note_local(record.keys[held - 1])
            return Taken(READY, tuple(payloads))

    # ------------------------------------------------------------------ the reader thread
    def _run(self) -> None:
        while (record := self._next()) is not None:
            self._read(record)

    def _next(self) -> Optional[_Prefetch]:
        with self._condition:
            while not self._queue and not self._closed:
                self._condition.wait()
            if self._closed:
                return None
            record = self._queue.popleft()
            record.state = "running"
            self._busy = True
            return record

    def _read(self, record: _Prefetch) -> None:
        """Look ``record``'s pages up and get them; nothing raises out of here."""
        try:
            with self._condition:
                start = self._held_pages(record.keys)
                self._counts["skipped_local_pages"] += start
            keys = record.keys[start:]
            found = self.remote.lookup_keys(keys) if keys else 0
            count = min(found, self.max_staged_bytes // self.page_bytes)
            payloads = self.remote.load_keys(keys[:count]) if count else []
        # RemoteKV turns store faults into misses; anything else is a bug that must not stop the reader
        except Exception:
            logger.exception("kvplug store reader: a prefetch of %d pages failed", len(record.keys))
            with self._condition:
                self._counts["errors"] += 1
                if record in self._records:
                    self._drop(record)
                self._busy = False
                self._condition.notify_all()
            return
        with self._condition:
            self._busy = False
            self._condition.notify_all()
            if record.state != "running":  # dropped while it ran: its admission gave up, or closed
                return
            record.start, record.state = start, "staged"
            self._stage(record, payloads)
            record.done.set()

    def _stage(self, record: _Prefetch, payloads: list) -> None:
        nbytes = sum(len(payload) for payload in payloads)
        for older in list(self._records):  # oldest first
            if self._counts["staged_bytes"] + nbytes <= self.max_staged_bytes:
                break
            if older is not record and older.state == "staged" and older.nbytes:
                self._drop(older)
        while payloads and self._counts["staged_bytes"] + nbytes > self.max_staged_bytes:
            nbytes -= len(payloads.pop())  # still too much: the newest keeps what fits
        record.payloads, record.nbytes = tuple(payloads), nbytes
        self._counts["staged_pages"] += len(payloads)
        self._counts["staged_bytes"] += nbytes

    # ------------------------------------------------------------------ bookkeeping (under the lock)
    def _held_pages(self, keys: tuple[str, ...]) -> int:
        local = self._local
        if not local:
            return 0
        for index in range(len(keys) - 1, -1, -1):
            if keys[index] in local:
                return index + 1
        return 0

    def _note_local(self, key: str) -> None:
        local = self._local
        local[key] = None
        local.move_to_end(key)
        if len(local) > _LOCAL_KEYS:
            local.popitem(last=False)

    def _forget(self, record: _Prefetch) -> None:
        """Take ``record`` out of the index and the bound (taken, or dropped)."""
        self._records.pop(record, None)
        for name in record.names:
            if self._index.get(name) is record:
                del self._index[name]
        if record.state == "staged":
            self._counts["staged_pages"] -= len(record.payloads)
            self._counts["staged_bytes"] -= record.nbytes
        if record.state == "queued":
            try:
                self._queue.remove(record)
            except ValueError:
                pass

    def _drop(self, record: _Prefetch) -> None:
        self._forget(record)
        record.state = "dropped"
        record.payloads, record.nbytes = (), 0
        record.done.set()  # an admission waiting for it stops waiting
        self._counts["dropped"] += 1
