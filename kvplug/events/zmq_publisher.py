"""``ZmqEventPublisher``: KV event batches on a ZMQ PUB socket, with a replay socket, as vLLM's.

The host's step thread only queues a batch (``publish``: a non-blocking put on a bounded queue;
a full queue drops the batch and counts it). A thread of the publisher's own owns both sockets
(ZMQ sockets belong to one thread): it encodes each batch (``kvplug.events.wire``), gives it the
next sequence number, sends ``[topic, seq, payload]`` and keeps the last ``buffer_steps``
payloads for replay. The PUB socket never blocks either: past its high-water mark ZMQ drops.

Sequence numbers start at the publisher's start time in microseconds since the epoch, not at 0:
after a restart a router sees the numbers jump and knows it missed something (the new process
starts with ``AllBlocksCleared`` anyway), instead of reading the new stream as old messages.

The PUB socket is an XPUB (a PUB to every subscriber) so the publisher hears each subscription:
it answers one with an empty batch at once, which tells the subscriber the current sequence number.
A router that reconnects to a restarted server (ZMQ reconnects by itself; what was published
before it did is lost to it) therefore sees the jump, replays from the last number it had, and
gets this run's first batch, ``AllBlocksCleared``, instead of keeping the old run's pages until
the next step.

Replay (vLLM's protocol): a client sends the first sequence number it wants (8 bytes,
big-endian) to the ROUTER socket, from a REQ socket or a DEALER with an empty delimiter frame;
the publisher answers with every buffered ``[topic, seq, payload]`` from that number on, then
``[b"", -1, b""]``, each behind the client's envelope.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Optional

from kvplug.events.config import FLAG, KVEventsConfig
from kvplug.events.extra import import_extra
from kvplug.events.publisher import EventBatch, KVEventPublisher, PublisherStats
from kvplug.events.wire import END_OF_REPLAY, encode_batch, sequence_bytes
from kvplug.interface import KVPlugError
from kvplug.interface.prefix_cache import AllCleared

logger = logging.getLogger("kvplug.events")
POLL_S = 0.02  # the thread's wait for a batch: also how long a replay request may wait for an answer
START_TIMEOUT_S = 10.0
MAX_REPLAYS_PER_WAKE = 16


class ZmqEventPublisher(KVEventPublisher):
    """Args:
    config: the ``KVEventsConfig`` (``publisher == "zmq"``).
    data_parallel_rank: the third field of every payload.
    first_sequence: the first batch's sequence number (default: now, in microseconds).
    """

    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int = 0,
                 first_sequence: Optional[int] = None) -> None:
        self._zmq = import_extra("zmq")
        import_extra("msgpack")  # the thread encodes with it: missing, it fails here, not there
        self.config = config
        self._rank = data_parallel_rank
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque = deque(maxlen=config.buffer_steps)
        self._next = time.time_ns() // 1000 if first_sequence is None else int(first_sequence)
        self._resync = False  # a batch was dropped: the next one that fits starts with AllBlocksCleared
        self._clear_next = False  # the same, for a batch the publisher thread failed to send
        self._send_failed = False  # logged once
        self._published_batches = self._published_events = 0
        self._dropped_batches = self._dropped_events = 0  # written by the step thread
        self._failed_batches = self._failed_events = 0  # the same, written by the publisher thread
        self._replay_requests = self._replay_errors = 0
        self._stop = threading.Event()
        self._close_deadline = float("inf")
        self._ready = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="kvplug-kv-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            self._stop.set()
            raise KVPlugError(f"{FLAG}: the publisher's sockets were not ready within {START_TIMEOUT_S:.0f} s")
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    # ------------------------------------------------------------------ the step thread
    def publish(self, batch: EventBatch) -> bool:
        if self._stop.is_set():
            return False
        if self._resync:
            batch = EventBatch(batch.timestamp, (AllCleared(), *batch.events))
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._dropped_batches += 1
            self._dropped_events += len(batch.events)
            self._resync = True
            return False
        self._resync = False
        return True

    def stats(self) -> PublisherStats:
        return PublisherStats(
            "zmq", self.config.endpoint, self.config.replay_endpoint, self.config.topic,
            self._published_batches, self._published_events, self._dropped_batches + self._failed_batches,
            self._dropped_events + self._failed_events,
            self._queue.qsize(), self._replay_requests, self._replay_errors, self._next,
        )

    def close(self, timeout: float = 1.0) -> None:
        self._close_deadline = time.monotonic() + timeout
        self._stop.set()
        self._thread.join(timeout + 1.0)

    # ------------------------------------------------------------------ the publisher thread
    def _run(self) -> None:
        zmq = self._zmq
        context = zmq.Context.instance()
        pub = replay = None
        try:
            try:
                pub, replay = self._open(context)
            except BaseException as error:  # reported by __init__ on the caller's thread
                self._start_error = error
                return
            finally:
                self._ready.set()
            while True:
                if self._subscribed(pub):
                    self._send(pub, EventBatch(time.time(), ()))
                if replay is not None:
                    for _ in range(MAX_REPLAYS_PER_WAKE):  # batches keep flowing while clients ask
                        if not replay.poll(0):
                            break
                        self._answer_replay(replay)
                if self._stop.is_set() and (self._queue.empty() or time.monotonic() > self._close_deadline):
                    return
                try:
                    batch = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                try:
                    self._send(pub, batch)
                except Exception:  # a batch that cannot be encoded or sent is lost: the router is told
                    self._failed_batches += 1
                    self._failed_events += len(batch.events)
                    self._clear_next = True
                    if not self._send_failed:
                        logger.exception("kvplug: a KV event batch could not be published (counted as dropped)")
                        self._send_failed = True
        except Exception:  # never silent: a dead publisher thread is logged once, the server keeps serving
            logger.exception("kvplug: the KV event publisher stopped")
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)

    def _subscribed(self, pub: Any) -> bool:
        """Whether a subscription arrived (``XPUB_VERBOSE``: every subscriber's, repeats included)."""
        joined = False
        while pub.poll(0):
            joined = pub.recv()[:1] == b"\x01" or joined  # b"\x00" + topic: an unsubscription
        return joined

    def _open(self, context: Any) -> tuple[Any, Any]:
        zmq = self._zmq
        config = self.config
        pub = context.socket(zmq.XPUB)
        replay = None
        try:
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            pub.setsockopt(zmq.SNDHWM, config.hwm)
            _attach(pub, "endpoint", config.endpoint, bind=config.bind)
            if config.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                _attach(replay, "replay_endpoint", config.replay_endpoint, bind=True)
        except BaseException:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        return pub, replay

    def _send(self, pub: Any, batch: EventBatch) -> None:
        events = batch.events
        if self._clear_next:
            events = (AllCleared(), *events)
        payload = encode_batch(batch.timestamp, events, self._rank)
        sequence = self._next
        pub.send_multipart((self._topic, sequence_bytes(sequence), payload), flags=self._zmq.NOBLOCK)
        self._buffer.append((sequence, payload))
        self._next = sequence + 1
        self._clear_next = False
        self._published_batches += 1
        self._published_events += len(events)

    def _answer_replay(self, replay: Any) -> None:
        frames = replay.recv_multipart()
        # [identity, b"", start] from REQ (or a DEALER sending the delimiter), [identity, start] from a DEALER
        if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8:
            envelope = frames[:2]
        elif len(frames) == 2 and len(frames[1]) == 8:
            envelope = frames[:1]
        else:
            self._replay_errors += 1
            return
        start = int.from_bytes(frames[-1], "big")
        self._replay_requests += 1
        for sequence, payload in list(self._buffer):
            if sequence >= start:
                replay.send_multipart([*envelope, self._topic, sequence_bytes(sequence), payload])
        replay.send_multipart([*envelope, b"", END_OF_REPLAY, b""])


def _attach(sock: Any, key: str, endpoint: str, *, bind: bool) -> None:
    """Bind (or connect) ``sock``; a failure names the key and the address."""
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except Exception as error:  # zmq.ZMQError: address in use, bad interface, ...
        verb = "bind" if bind else "connect to"
        raise KVPlugError(f"{FLAG}: cannot {verb} {key!r} {endpoint!r}: {error}") from error
