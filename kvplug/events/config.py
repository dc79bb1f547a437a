"""``KVEventsConfig``: where and how a server publishes its KV cache events (``--kv-events-config``).

The keys are vLLM's and SGLang's (``KVEventsConfig`` in ``vllm/config/kv_events.py``; SGLang's
``--kv-events-config`` takes the same JSON), so one command line configures any of the three
servers and the routers that read them (NVIDIA Dynamo, vllm-router, llm-d) need nothing new:

==================  =================  ===========================================================
key                 default            meaning
==================  =================  ===========================================================
``publisher``       ``"zmq"``          ``"zmq"`` publishes; ``"null"`` publishes nothing
``endpoint``        ``tcp://*:5557``   the ZMQ PUB socket's address
``replay_endpoint`` none               a ROUTER socket answering "batches from sequence number N"
``topic``           ``""``             the first frame of every message
``bind``            ``true``           the PUB socket binds ``endpoint``; ``false``: connects to it
``buffer_steps``    10000              batches kept for replay
``hwm``             100000             ZMQ send high-water mark of the PUB socket
``max_queue_size``  100000             batches waiting for the publisher thread; more are dropped
==================  =================  ===========================================================

vLLM's ``enable_kv_cache_events`` is accepted too (``false`` means ``publisher: "null"``). Any
other key, or a value of the wrong type, is an ``InvalidArgumentError`` naming the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from kvplug.interface import InvalidArgumentError

PUBLISHERS = ("zmq", "null")
TRANSPORTS = ("tcp://", "ipc://", "inproc://")
FLAG = "--kv-events-config"


@dataclass(frozen=True)
class KVEventsConfig:
    """See the module docstring; build one from JSON with ``parse_kv_events_config``."""

    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    topic: str = ""
    bind: bool = True
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise InvalidArgumentError(f"{FLAG}: 'publisher' must be one of {list(PUBLISHERS)}, got {self.publisher!r}")
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
            if self.replay_endpoint == self.endpoint:
                raise InvalidArgumentError(
                    f"{FLAG}: 'replay_endpoint' must differ from 'endpoint' (both are {self.endpoint!r})"
                )
        if not isinstance(self.topic, str):
            raise InvalidArgumentError(f"{FLAG}: 'topic' must be a string, got {self.topic!r}")
        if not isinstance(self.bind, bool):
            raise InvalidArgumentError(f"{FLAG}: 'bind' must be true or false, got {self.bind!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{FLAG}: {name!r} must be an int >= 1, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.publisher != "null"

    def to_json(self) -> dict:
        return {item.name: getattr(self, item.name) for item in fields(self)}


def parse_kv_events_config(value: str | Mapping[str, Any]) -> KVEventsConfig:
    """``KVEventsConfig`` from the flag's JSON text (or an already-parsed mapping)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise InvalidArgumentError(f"{FLAG} must be a JSON object, got {value!r}: {error}") from error
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{FLAG} must be a JSON object, got {value!r}")
    known = [item.name for item in fields(KVEventsConfig)]
    options = dict(value)
    enable = options.pop("enable_kv_cache_events", None)  # vLLM's switch
    if enable is not None:
        if not isinstance(enable, bool):
            raise InvalidArgumentError(f"{FLAG}: 'enable_kv_cache_events' must be true or false, got {enable!r}")
        if not enable:
            options.setdefault("publisher", "null")
    for key in options:
        if key not in known:
            raise InvalidArgumentError(
                f"{FLAG}: unknown key {key!r}; accepted keys: {', '.join([*known, 'enable_kv_cache_events'])}"
            )
    return KVEventsConfig(**options)


def _check_endpoint(key: str, endpoint: Any) -> None:
    if not isinstance(endpoint, str) or not endpoint.startswith(TRANSPORTS) or endpoint in TRANSPORTS:
        raise InvalidArgumentError(
            f"{FLAG}: {key!r} must be a ZMQ address ({', '.join(t + '...' for t in TRANSPORTS)}, e.g. "
            f"'tcp://127.0.0.1:5557'), got {endpoint!r}"
        )
