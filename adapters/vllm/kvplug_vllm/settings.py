"""``kv_connector_extra_config`` of ``KvplugConnector``, read and checked once at startup.

The user's spelling::

    --kv-transfer-config '{"kv_connector":"KvplugConnector","kv_role":"kv_both",
                           "kv_connector_extra_config":{"prefix_cache":"radix"}}'

``prefix_cache`` names any prefix cache kvplug's plugin registry knows (``naive``, ``radix`` or a
third-party plugin's), ``prefix_cache_options`` are the keyword options its factory takes. Every
problem is one ``InvalidArgumentError`` that names what is accepted; building one cache of the
named kind at startup also proves the name and options (``kvplug.UnknownComponentError`` lists
the names that exist and their plugins).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from kvplug.interface import InvalidArgumentError

KNOWN_KEYS = ("prefix_cache", "prefix_cache_options", "host_memory", "attention")
DEFAULT_PREFIX_CACHE = "radix"


@dataclass(frozen=True)
class KvplugSettings:
    """What ``KvplugConnector`` was asked for.

    Attributes:
        prefix_cache: the kvplug prefix-cache name.
        prefix_cache_options: keyword options for its factory.
    """

    prefix_cache: str = DEFAULT_PREFIX_CACHE
    prefix_cache_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_cache_options", MappingProxyType(dict(self.prefix_cache_options)))

    def to_json(self) -> dict[str, Any]:
        return {"prefix_cache": self.prefix_cache, "prefix_cache_options": dict(self.prefix_cache_options)}


def parse_settings(extra: Mapping[str, Any] | None) -> KvplugSettings:
    """``kv_connector_extra_config`` -> ``KvplugSettings``; ``InvalidArgumentError`` naming the problem."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KNOWN_KEYS))
    if unknown:
        raise InvalidArgumentError(
            f"KvplugConnector: unknown kv_connector_extra_config key(s) {unknown}; accepted: {list(KNOWN_KEYS)}"
        )
    if extra.get("host_memory") not in (None, "", 0, "0"):
        # refused rather than ignored: a user asking for a host tier must not silently run without one
        raise InvalidArgumentError(
            f"KvplugConnector: host_memory={extra['host_memory']!r} asks for kvplug's host-memory tier, which "
            "kvplug-vllm does not provide yet (its scheduler-side index and worker-side copies are not built); "
            "remove host_memory to run kvplug's prefix cache on vLLM's KV blocks only"
        )
    name = extra.get("prefix_cache", DEFAULT_PREFIX_CACHE)
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(
            f"KvplugConnector: prefix_cache must be a kvplug prefix-cache name (a non-empty string), got {name!r}"
        )
    options = extra.get("prefix_cache_options", {})
    if not isinstance(options, Mapping) or not all(isinstance(key, str) for key in options):
        raise InvalidArgumentError(
            f"KvplugConnector: prefix_cache_options must be a JSON object of keyword options, got {options!r}"
        )
    return KvplugSettings(prefix_cache=name, prefix_cache_options=options)
