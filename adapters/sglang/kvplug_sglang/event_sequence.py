"""SGLang's KV-event batches numbered from the server's start time, so a restart is seen (issue 27).

SGLang's ``ZmqEventPublisher`` numbers its batches 0, 1, 2, ... in every run. A router that keeps
reading a restarted server's address (NVIDIA Dynamo's indexer reconnects by itself) takes a
number at or below the last one it applied as an old, already-applied batch and drops it: the new
run's ``AllBlocksCleared`` and its first stores are ignored, and the old run's pages stay indexed
until the new run has published more batches than the old one did. ``kvplug serve`` numbers its
batches from its start time in microseconds instead (``kvplug.events.zmq_publisher``), so a
restarted server's numbers jump forward: the router sees a gap, replays it from the new run's
replay socket and gets this run's ``AllBlocksCleared``. ``number_from_start_time`` gives an SGLang
server with kvplug's tree cache the same numbering (``answering_publisher``, which also answers
each new subscriber at once, so a router that reconnects late still sees the jump); a native
SGLang server is left as it is. The numbers stay consecutive within a run, so SGLang's replay
socket answers as before.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


def first_sequence_number() -> int:
    """Now, in microseconds since the epoch (what ``kvplug serve`` starts at)."""
    return time.time_ns() // 1000


def number_from_start_time(publisher: Any) -> bool:
    """Make SGLang's ZMQ ``publisher`` number its batches from ``first_sequence_number()``.

    Called right after SGLang built it, before the scheduler queued any batch (the publisher's
    thread only draws a number for a queued batch). Returns False, and warns, for a publisher
    without SGLang 0.5.23's counter (another publisher kind, or another SGLang)."""
    counter = getattr(publisher, "_seq_gen", None)
    if not isinstance(counter, itertools.count):
        logger.warning(
            "kvplug-sglang: the KV-event publisher %s has no batch counter to start at the server's start "
            "time (expected SGLang's ZmqEventPublisher._seq_gen, an itertools.count; got %r): a router may "
            "keep a restarted server's old pages indexed", type(publisher).__name__, counter,
        )  # fmt: skip
        return False
    first = first_sequence_number()
    publisher._seq_gen = itertools.count(first)
    logger.info("kvplug-sglang: KV-event batches are numbered from %d (the start time, in microseconds)", first)
    return True
