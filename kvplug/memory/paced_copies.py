"""Device -> host copies of the host-memory tier, issued one small chunk at a time by a worker thread.

Why: device -> host copies share one copy engine whatever their stream, and while another
stream keeps the engine fed (even with two chunks queued), a copy from the compute stream waits
for everything queued before it. A serving engine copies a few bytes to the host every step (its
sampled ids), so a write-back issued at once stalls the step behind it; with one chunk in flight
that step waits for at most one chunk, at a small cost in write-back speed (measured:
BENCHMARKS.md, "Host-memory tier on the H200"; ``benchmarks/copy_engine_contention.py``).

How: ``submit`` queues a copy (a host view and a device view of the same shape, and the event that
says the device view is ready: the gather that filled it, on the compute stream) and returns at
once. The worker issues the queued copies in order on the tier's copy stream, each cut into
chunks along its first dimension, waiting (without the GIL) for each chunk before issuing the
next. A device view stays referenced until its last chunk has completed, so its memory (the
staging buffer) is reused only after the copy read it. Nothing here reorders copies: everything is
issued on one stream in submission order, and ``issue_through_pages`` lets a reader of host pages
(a load) wait until the copies writing them have been *issued* before it issues its own copy on
the same stream.

Completion: the worker records an event after each chunk and waits on it (off the serving thread)
before the next; when a copy's last chunk is done the copy is *complete*. ``wait_complete``
(for a thread that may block: the store writer, issue 30) returns once a copy is complete, and
``pages_busy`` tells without blocking whether an incomplete copy writes any of some host pages (a
CPU write into host pages, a store read, must not race a copy still writing them).

A copy that fails in the worker (a CUDA error) is logged, and every later ``submit`` and
``issue_through`` raises ``RuntimeError`` naming it: the host pages written since are not
trustworthy, so the tier must stop serving them (the caller turns it into ``TierCopyError``; the
prefixes are recomputed, never served stale).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import NamedTuple, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)


class _Copy(NamedTuple):
    ticket: int
    host: torch.Tensor      # destination, pinned host memory; shape [m, ...]
    device: torch.Tensor    # source, same shape, on the device
    ready: torch.cuda.Event  # recorded on the stream that filled ``device``
    host_pages: np.ndarray  # host page numbers written (for ``issue_through_pages``), int64


class PacedHostCopies:
    """Device -> host copies issued by a worker thread, ``max_in_flight`` chunks at a time (see above).

    Args:
        stream: the copy stream every copy is issued on (the host tier's).
        chunk_bytes: largest single copy issued.
        max_in_flight: chunks queued on the copy engine at once; 1, because with 2 the engine
            never runs dry and other streams' device -> host copies wait for all of it.
    """

    def __init__(self, stream: torch.cuda.Stream, *, chunk_bytes: int = 16 << 20, max_in_flight: int = 1) -> None:
        self._stream = stream
        self._chunk_bytes = chunk_bytes
        self._max_in_flight = max_in_flight
        self._queue: collections.deque[_Copy] = collections.deque()
        self._condition = threading.Condition()
        self._submitted = 0  # tickets handed out
        self._issued = 0     # every copy up to this ticket is issued on the stream
        self._complete = 0   # every copy up to this ticket has completed on the device
        self._incomplete: collections.deque[tuple[int, np.ndarray]] = collections.deque()  # (ticket, host pages)
        self._failure: Optional[BaseException] = None
        self._closing = False
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ callers (the tier's thread)
    def submit(self, host: torch.Tensor, device: torch.Tensor, ready: torch.cuda.Event, host_pages: np.ndarray) -> int:
        """Queue ``host.copy_(device)`` after ``ready``; returns its ticket."""
        with self._condition:
            self._raise_failure()
            self._submitted += 1
            self._queue.append(_Copy(self._submitted, host, device, ready, host_pages))
            self._incomplete.append((self._submitted, host_pages))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvplug-host-tier-writes", daemon=True)
                self._thread.start()
            self._condition.notify_all()
            return self._submitted

    def issue_through_pages(self, host_pages: np.ndarray) -> None:
        """Return once every queued copy writing any of ``host_pages`` is issued on the stream
        (at once when none is queued: the usual case for a load)."""
        with self._condition:
            self._raise_failure()
            last = 0
            for copy in self._queue:
                if copy.ticket > last and np.intersect1d(copy.host_pages, host_pages, assume_unique=False).size:
                    last = copy.ticket
        if last:
            self.issue_through(last)

    def issue_through(self, ticket: Optional[int] = None) -> None:
        """Return once every copy up to ``ticket`` (default: all submitted) is issued on the stream."""
        with self._condition:
            target = self._submitted if ticket is None else ticket
            while self._issued < target and self._failure is None:
                self._condition.wait()
            self._raise_failure()

    def wait_complete(self, ticket: int) -> None:
        """Block until copy ``ticket`` (and every one before it) has completed on the device; for
        a thread that may wait (never the serving thread). ``RuntimeError`` if the worker failed."""
        with self._condition:
            while self._complete < ticket and self._failure is None:
                self._condition.wait()
            self._raise_failure()

    def pages_busy(self, host_pages: np.ndarray) -> bool:
        """Whether a copy not yet complete writes any of ``host_pages``; never blocks (a failed
        worker counts as busy: nothing it wrote may be trusted)."""
        with self._condition:
            if self._failure is not None:
                return True
            return any(np.intersect1d(pages, host_pages).size for _, pages in self._incomplete)

    @property
    def pending(self) -> int:
        """Copies submitted but not issued yet."""
        return self._submitted - self._issued

    def close(self) -> None:
        """Issue what is queued, wait for it, and stop the worker."""
        with self._condition:
            self._closing = True
            self._condition.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the host tier's copy worker failed earlier: {self._failure!r}")

    # ------------------------------------------------------------------ the worker
    def _run(self) -> None:
        in_flight: collections.deque[tuple[torch.cuda.Event, _Copy, bool]] = collections.deque()
        try:
            while True:
                with self._condition:
                    while not self._queue and not self._closing:
                        if in_flight:
                            break
                        self._condition.wait()
                    copy = self._queue[0] if self._queue else None
                    if copy is None and self._closing and not in_flight:
                        return
                if copy is None:  # idle: let the copies in flight finish, free their device views
                    self._finish(in_flight.popleft())
                    continue
                self._issue(copy, in_flight)
                with self._condition:
                    self._queue.popleft()
                    self._issued = copy.ticket
                    self._condition.notify_all()
        except BaseException as error:  # noqa: BLE001 -- reported to every later caller
            logger.error("kvplug host tier: a device -> host copy failed in the copy worker: %r", error)
            with self._condition:
                self._failure = error
                self._condition.notify_all()

    def _issue(self, copy: _Copy, in_flight: collections.deque) -> None:
        """Issue ``copy`` in chunks, never more than ``max_in_flight`` queued on the engine."""
        rows = copy.host.shape[0]
        row_bytes = max(1, copy.host[:1].numel() * copy.host.element_size())
        step = max(1, self._chunk_bytes // row_bytes)
        stream = self._stream
        with torch.cuda.stream(stream):
            stream.wait_event(copy.ready)
            for begin in range(0, rows, step):
                while len(in_flight) >= self._max_in_flight:
                    self._finish(in_flight.popleft())
                copy.host[begin : begin + step].copy_(copy.device[begin : begin + step], non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                in_flight.append((done, copy, begin + step >= rows))  # keeps the device view alive until done

    def _finish(self, chunk: tuple[torch.cuda.Event, _Copy, bool]) -> None:
        """Wait for one chunk in flight (releases the GIL); the last one of a copy completes it."""
        done, copy, last = chunk
        done.synchronize()
        if last:
            with self._condition:
                self._complete = copy.ticket
                while self._incomplete and self._incomplete[0][0] <= copy.ticket:
                    self._incomplete.popleft()
                self._condition.notify_all()
