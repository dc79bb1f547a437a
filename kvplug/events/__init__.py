"""KV cache events on the wire: what routers (NVIDIA Dynamo, vllm-router, llm-d) read from a server.

A host adds a ``KVEventCollector`` to its prefix caches and calls ``end_step`` once per step;
the collector hands each step's ``BlockStored`` / ``BlockRemoved`` / ``AllCleared`` events to a
``KVEventPublisher`` (``create_publisher(parse_kv_events_config(json))``), which sends them in
vLLM's and SGLang's ZMQ wire format (``kvplug.events.wire``) from a thread of its own. pyzmq and
msgpack (the ``events`` extra) are imported only when a ZMQ publisher is built; the names below
on first access (the config parses without torch).
"""

from kvplug.lazy_names import lazy_attributes

_LAZY_NAMES = {
    "KVEventCollector": "kvplug.events.collector",
    **dict.fromkeys(("KVEventsConfig", "parse_kv_events_config"), "kvplug.events.config"),
    **dict.fromkeys(("EventBatch", "KVEventPublisher", "NullEventPublisher", "PublisherStats", "create_publisher"),
                    "kvplug.events.publisher"),
}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY_NAMES, submodules=True)

__all__ = [
    "EventBatch",
    "KVEventCollector",
    "KVEventPublisher",
    "KVEventsConfig",
    "NullEventPublisher",
    "PublisherStats",
    "create_publisher",
    "parse_kv_events_config",
]
