"""``KVEventCollector``: a prefix cache's KV events, gathered during a step, published once per step.

It is the listener a host adds to its prefix caches (``attach``): an event costs one list append
on the step thread. ``end_step`` (called by the host once per scheduler iteration, on the same
thread) hands what the step produced to the publisher as one ``EventBatch``. Attaching a cache
reports ``AllCleared`` first: a new cache starts empty, so whatever a router learnt from an
earlier cache of this server (or an earlier run of it) is gone.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvplug.events.publisher import EventBatch, KVEventPublisher
from kvplug.interface.prefix_cache import AllCleared, BasePrefixCache

logger = logging.getLogger("kvplug.events")


class KVEventCollector:
    """Args:
    publisher: where ``end_step`` sends each step's batch.
    """

    def __init__(self, publisher: KVEventPublisher) -> None:
        self.publisher = publisher
        self._pending: list = []

    def __call__(self, event: Any) -> None:
        self._pending.append(event)

    def attach(self, cache: BasePrefixCache) -> bool:
        """Listen to ``cache`` from now on; ``False`` (and a warning) when it publishes no events."""
        self._pending.append(AllCleared())
        if cache.add_kv_event_listener(self):
            return True
        logger.warning(
            "kvplug: prefix cache %s reports no KV events: routers reading this server's events see it as empty",
            type(cache).__name__,
        )
        return False

    def detach(self, cache: BasePrefixCache) -> None:
        cache.remove_kv_event_listener(self)

    @property
    def pending(self) -> int:
        """Events gathered since the last ``end_step``."""
        return len(self._pending)

    def end_step(self) -> None:
        """Publish the events gathered since the last call as one batch (nothing when there are none)."""
        if self._pending:
            events, self._pending = tuple(self._pending), []
            self.publisher.publish(EventBatch(time.time(), events))
