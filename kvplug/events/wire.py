"""vLLM's and SGLang's KV-event wire format, for kvplug's events (``kvplug.interface.BlockStored`` ...).

One ZMQ message per batch, three frames: ``[topic, sequence number (u64, big-endian), payload]``.
The payload is msgpack of ``[timestamp (float64, Unix seconds), events, data_parallel_rank]``,
vLLM's ``KVEventBatch`` as msgspec encodes it (``array_like=True``). Each event is a map tagged by
``"type"`` (vLLM's ``KVCacheEvent``: ``tag=True``, ``omit_defaults=True``), with vLLM's fields in
vLLM's order; fields vLLM gives a default and kvplug leaves at it are omitted, as msgspec omits
them:

- ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
  "lora_id", "medium", "lora_name"}``
- ``{"type": "BlockRemoved", "block_hashes", "medium"}``
- ``{"type": "AllBlocksCleared"}``

Hashes are kvplug's page hashes (``kvplug.prefix_cache.block_hashes``, signed 64-bit), which
chain a page to its parent as vLLM's and SGLang's do; routers that rebuild the tree from
``token_ids`` (Dynamo) only use them to link parents and removals. ``medium`` is ``"GPU"`` for the
KV pool and ``"CPU_PINNED"`` for the host-memory tier (SGLang HiCache's name, which Dynamo counts
as its host tier). A replay reply repeats the stored frames; its end is ``[b"", -1 (i64,
big-endian), b""]`` (``END_OF_REPLAY``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from kvplug.events.extra import import_extra
from kvplug.interface import InvalidArgumentError
from kvplug.interface.prefix_cache import KV_MEDIUM_DEVICE, AllCleared, BlockRemoved, BlockStored
from kvplug.interface.tiered_cache import KV_MEDIUM_HOST

#: kvplug's media as the wire names them
WIRE_MEDIUM = {KV_MEDIUM_DEVICE: "GPU", KV_MEDIUM_HOST: "CPU_PINNED"}
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class WireBatch(NamedTuple):
    """A decoded payload: ``events`` are the tagged maps as msgpack gives them back."""

    timestamp: float
    events: list
    data_parallel_rank: int | None


def wire_event(event: Any) -> dict:
    """One kvplug KV event as its tagged map."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": WIRE_MEDIUM.get(event.medium, event.medium),
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": WIRE_MEDIUM.get(event.medium, event.medium),
        }
    if isinstance(event, AllCleared):
        return {"type": "AllBlocksCleared"}
    raise InvalidArgumentError(
        f"expected a kvplug KV event (BlockStored, BlockRemoved, AllCleared), got {type(event).__name__}"
    )


def encode_batch(timestamp: float, events: Sequence[Any], data_parallel_rank: int = 0) -> bytes:
    """The payload frame of one batch."""
    msgpack = import_extra("msgpack")
    return msgpack.packb([float(timestamp), [wire_event(event) for event in events], data_parallel_rank],
                         use_bin_type=True)


def decode_batch(payload: bytes) -> WireBatch:
    """A payload frame back, read by position as routers read it (for tests and tools)."""
    msgpack = import_extra("msgpack")
    fields = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(fields, list) or len(fields) not in (2, 3):
        raise InvalidArgumentError(f"a KV event batch is [timestamp, events, dp_rank], got {fields!r:.200}")
    return WireBatch(fields[0], fields[1], fields[2] if len(fields) == 3 else None)


def sequence_bytes(sequence: int) -> bytes:
    """The sequence-number frame: u64, big-endian."""
    return sequence.to_bytes(8, "big")


def sequence_number(frame: bytes) -> int:
    """A sequence-number frame back (signed: the end-of-replay marker reads -1)."""
    if len(frame) != 8:
        raise InvalidArgumentError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
