"""SGLang's ZMQ KV-event publisher answering each new subscriber with a batch, as ``kvplug serve``'s does
(issue 27: a restarted SGLang server behind NVIDIA Dynamo's KV router left a stale score).

Why: a router's SUB socket reconnects to a restarted server by itself, but with a backoff (Dynamo's
libzmq socket: 100 ms doubling to 5 s), so it subscribes again up to 5 s after the new server
binds. A starting SGLang server publishes its ``AllBlocksCleared`` and its warm-up request's
stores within about a second of binding and then nothing until the next request. When those went
out before the router was back, it read no batch of the new run: no gap, no replay, and the old
run's pages stayed indexed. ``kvplug serve``'s publisher (``kvplug.events.zmq_publisher``) hears
each subscription on an XPUB socket and answers it at once with an empty batch carrying the next
sequence number; with the numbers starting at the start time (``event_sequence``) the router then
sees the jump, replays from the new run's replay socket and gets its ``AllBlocksCleared``.

``AnsweringZmqEventPublisher`` gives an SGLang server with kvplug's tree cache the same: SGLang's
own ``ZmqEventPublisher`` (its sockets, numbering, replay buffer and replay socket), with the PUB
socket an XPUB and its queue an ``AnsweringQueue``. SGLang's publisher thread takes every batch
from that queue; the queue, on that thread (which owns the socket), first reads the subscriptions
that arrived and queues one empty ``KVEventBatch`` for them, which the thread then numbers, sends
and keeps for replay like any other batch. It is registered with SGLang's public
``EventPublisherFactory.register_publisher`` as ``PUBLISHER``; ``hooks.around_init_kv_events``
picks it for a ``"publisher": "zmq"`` config when the tree cache is kvplug's.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any, Optional

import zmq
from sglang.srt.disaggregation.kv_events import EventPublisherFactory, KVEventBatch, ZmqEventPublisher

from kvplug_sglang.event_sequence import number_from_start_time

logger = logging.getLogger(__name__)

PUBLISHER = "kvplug-zmq"  # the name it is registered under
REPLACES = "zmq"  # the publisher kind it stands in for


class AnsweringQueue(queue.Queue):
    """SGLang's batch queue that, once ``answer(xpub)`` named the socket, queues an empty batch for
    the subscriptions read from it each time the publisher thread takes a batch."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        self._xpub: Optional[Any] = None  # read by the publisher thread only
        self.answered = 0  # empty batches queued for new subscribers

    def answer(self, xpub: Any) -> None:
        """Start answering ``xpub``'s subscriptions (once its publisher numbers from the start time)."""
        self._xpub = xpub

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        if self._xpub is not None and _subscribed(self._xpub):
            try:
                self.put_nowait(KVEventBatch(ts=time.time(), events=[]))
                self.answered += 1
            except queue.Full:  # batches are waiting: the first one sent tells the subscriber the number
                pass
        return super().get(block, timeout)


def _subscribed(xpub: Any) -> bool:
    """Whether a subscription arrived (``XPUB_VERBOSE``: every subscriber's, repeats included)."""
    joined = False
    while xpub.poll(0):
        joined = xpub.recv()[:1] == b"\x01" or joined  # b"\x00" + topic: an unsubscription
    return joined


class AnsweringZmqEventPublisher(ZmqEventPublisher):
    """SGLang's ``ZmqEventPublisher`` (same arguments), numbered from the start time, answering each
    new subscriber with an empty batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        number_from_start_time(self)  # before the first answer draws a number
        self._event_queue.answer(self._pub)
        logger.info("kvplug-sglang: the KV-event publisher answers each new subscriber with a batch (issue 27)")

    def _socket_setup(self) -> None:
        """SGLang's, with an XPUB where it makes a PUB (SGLang then sets up only the replay socket)."""
        self._event_queue = AnsweringQueue(self._event_queue.maxsize)
        if self._pub is None:
            pub = self._ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            pub.set_hwm(self._hwm)
            if _binds(self._endpoint, self._bind):
                pub.bind(self._endpoint)
                self._local_pub_endpoint = self._bound_endpoint(pub)
            else:
                pub.connect(self._endpoint)
            self._pub = pub
        super()._socket_setup()


def _binds(endpoint: str, bind: Optional[bool]) -> bool:
    """SGLang's rule (``ZmqEventPublisher._socket_setup``): ``bind`` when given, else bind a
    wildcard, ``ipc://`` or ``inproc://`` address and connect to any other."""
    if bind is not None:
        return bind
    wildcard = "*" in endpoint or "::" in endpoint or "0.0.0.0" in endpoint
    return wildcard or endpoint.startswith(("ipc://", "inproc://"))


def register() -> None:
    """Register the publisher with SGLang's factory (once per process; again is a no-op)."""
    try:
        EventPublisherFactory.register_publisher(PUBLISHER, AnsweringZmqEventPublisher)
    except KeyError:  # already registered in this process
        pass


def answering_config(kv_events_config: str) -> str:
    """``kv_events_config`` with ``AnsweringZmqEventPublisher`` for a ``"zmq"`` publisher; another kind
    (``"null"``, one registered by someone else) is returned as it is."""
    from sglang.srt.disaggregation.kv_events import KVEventsConfig

    config = KVEventsConfig.from_cli(kv_events_config)
    if config.publisher != REPLACES:
        return kv_events_config
    register()
    return config.model_copy(update={"publisher": PUBLISHER}).model_dump_json()
