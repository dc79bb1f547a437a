"""kvplug's KV events published by vLLM's own publisher (``--kv-events-config``).

kvplug replaces vLLM's hash index, so the block pool's events (``KVCacheManager.take_events``)
describe nothing that is cached. The seam vLLM 0.32.0 offers instead is the connector's
``take_events``: ``Scheduler.update_from_output`` publishes what it returns, with the manager's
events, once per step. ``VLLMEventRecorder`` is the kvplug event listener every namespace's cache
gets (``BlockPrefixCache``): kvplug's ``BlockStored`` / ``BlockRemoved`` / ``AllCleared`` (hashes
chained by ``kvplug.prefix_cache.block_hashes``, the hashes ``kvplug serve`` publishes) become
vLLM's event classes, medium ``GPU`` (``kvplug.events.wire.WIRE_MEDIUM``), and the connector hands
them to vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from kvplug.events.wire import WIRE_MEDIUM
from kvplug.interface.prefix_cache import AllCleared
from kvplug.interface.prefix_cache import BlockRemoved as KvplugBlockRemoved
from kvplug.interface.prefix_cache import BlockStored as KvplugBlockStored


class VLLMEventRecorder:
    """A kvplug KV event listener that keeps vLLM events until ``take`` (one step's worth)."""

    def __init__(self) -> None:
        self._events: list = []

    def __call__(self, event: Any) -> None:
        if isinstance(event, KvplugBlockStored):
            self._events.append(BlockStored(
                block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
                token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None,
                medium=WIRE_MEDIUM.get(event.medium, event.medium), lora_name=None,
            ))
        elif isinstance(event, KvplugBlockRemoved):
            self._events.append(BlockRemoved(block_hashes=list(event.block_hashes),
                                             medium=WIRE_MEDIUM.get(event.medium, event.medium)))
        elif isinstance(event, AllCleared):
            self.all_cleared()

    def all_cleared(self) -> None:
        if not (self._events and isinstance(self._events[-1], AllBlocksCleared)):  # one clear is enough
            self._events.append(AllBlocksCleared())

    def take(self) -> list:
        events, self._events = self._events, []
        return events
