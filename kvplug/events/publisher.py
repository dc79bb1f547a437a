"""``KVEventPublisher``: what a host hands its batches of KV events to, once per scheduler step.

``publish`` never blocks the step: a publisher queues the batch (bounded) and sends it from a
thread of its own; a batch that does not fit is dropped and counted (``PublisherStats``).
``create_publisher(config)`` builds the one a ``KVEventsConfig`` names (``"zmq"``:
``kvplug.events.zmq_publisher.ZmqEventPublisher``; ``"null"``: ``NullEventPublisher``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple, Optional

from kvplug.events.config import KVEventsConfig


class EventBatch(NamedTuple):
    """Events of one step, in the order the caches reported them; ``timestamp``: Unix seconds."""

    timestamp: float
    events: tuple


class PublisherStats(NamedTuple):
    """Counters of a publisher (``/kvplug/stats`` shows them as ``kv_events``).

    Attributes:
        published_batches, published_events: sent on the PUB socket.
        dropped_batches, dropped_events: refused by ``publish`` (the queue was full), or that the
            publisher thread failed to encode or send. The next batch sent starts with
            ``AllBlocksCleared``, so a router forgets what it might never hear removed rather than
            keep it.
        queued_batches: waiting for the publisher thread now.
        replay_requests: replay requests answered; ``replay_errors``: malformed ones ignored.
        next_sequence: the sequence number the next batch gets.
    """

    publisher: str
    endpoint: Optional[str] = None
    replay_endpoint: Optional[str] = None
    topic: str = ""
    published_batches: int = 0
    published_events: int = 0
    dropped_batches: int = 0
    dropped_events: int = 0
    queued_batches: int = 0
    replay_requests: int = 0
    replay_errors: int = 0
    next_sequence: Optional[int] = None

    def to_json(self) -> dict:
        return self._asdict()


class KVEventPublisher(ABC):
    """Sends batches of KV events to routers."""

    @abstractmethod
    def publish(self, batch: EventBatch) -> bool:
        """Queue ``batch`` without blocking; ``False`` when it was dropped (counted)."""

    @abstractmethod
    def stats(self) -> PublisherStats:
        """Counters now; callable from any thread."""

    @abstractmethod
    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), then release the sockets."""


class NullEventPublisher(KVEventPublisher):
    """Publishes nothing (``"publisher": "null"``)."""

    def publish(self, batch: EventBatch) -> bool:
        return True

    def stats(self) -> PublisherStats:
        return PublisherStats("null")

    def close(self, timeout: float = 1.0) -> None:
        return None


def create_publisher(config: KVEventsConfig, **options: Any) -> KVEventPublisher:
    """The publisher ``config`` names; ``options`` go to ``ZmqEventPublisher``. Binding happens
    here: an address in use is a ``KVPlugError`` now, not a silent thread failure later."""
    if not config.enabled:
        return NullEventPublisher()
    from kvplug.events.zmq_publisher import ZmqEventPublisher

    return ZmqEventPublisher(config, **options)
