"""``kv_connector_extra_config`` of ``KvplugConnector``, read and checked once at startup.

The user's spelling::

    --kv-transfer-config '{"kv_connector":"KvplugConnector","kv_role":"kv_both",
                           "kv_connector_extra_config":{"prefix_cache":"radix"}}'

``prefix_cache`` names any prefix cache kvplug's plugin registry knows (``naive``, ``radix`` or a
third-party plugin's), ``prefix_cache_options`` are the keyword options its factory takes. Every
problem is one ``InvalidArgumentError`` that names what is accepted; building one cache of the
named kind at startup also proves the name and options (``kvplug.UnknownComponentError`` lists
the names that exist and their plugins). ``host_memory`` (bytes or ``"4GiB"``) adds kvplug's
host-memory tier under a tiered cache (``radix``); whether it holds at least one page and fits in
free host memory is checked once the KV cache's page size is known (the connector).
``on_cache_failure`` is what a run-time fault of an untrusted plugin does (``quarantine``):
``"fallback"`` (default: ``naive`` takes over) or ``"fail"`` (the engine stops, as ``kvplug serve
--on-cache-failure fail`` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from kvplug.cache_guard import POLICIES
from kvplug.interface import InvalidArgumentError
from kvplug.memory.capacity import parse_memory_size

KNOWN_KEYS = ("prefix_cache", "prefix_cache_options", "host_memory", "attention", "on_cache_failure")
DEFAULT_PREFIX_CACHE = "radix"


@dataclass(frozen=True)
class KvplugSettings:
    """What ``KvplugConnector`` was asked for.

    Attributes:
        prefix_cache: the kvplug prefix-cache name.
        prefix_cache_options: keyword options for its factory.
        host_memory: bytes of kvplug's host-memory tier (``None``: no tier).
        on_cache_failure: ``"fallback"`` or ``"fail"`` (``kvplug.cache_guard.POLICIES``).
    """

    prefix_cache: str = DEFAULT_PREFIX_CACHE
    prefix_cache_options: Mapping[str, Any] = field(default_factory=dict)
    host_memory: int | None = None
    on_cache_failure: str = "fallback"

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_cache_options", MappingProxyType(dict(self.prefix_cache_options)))

    def to_json(self) -> dict[str, Any]:
        return {"prefix_cache": self.prefix_cache, "prefix_cache_options": dict(self.prefix_cache_options),
                "host_memory": self.host_memory, "on_cache_failure": self.on_cache_failure}


def parse_settings(extra: Mapping[str, Any] | None) -> KvplugSettings:
    """``kv_connector_extra_config`` -> ``KvplugSettings``; ``InvalidArgumentError`` naming the problem."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KNOWN_KEYS))
    if unknown:
        raise InvalidArgumentError(
            f"KvplugConnector: unknown kv_connector_extra_config key(s) {unknown}; accepted: {list(KNOWN_KEYS)}"
        )
    host_memory = extra.get("host_memory")
    if host_memory in (None, "", 0, "0"):
        host_memory = None
    else:
        try:
            host_memory = parse_memory_size(host_memory)
        except (InvalidArgumentError, TypeError, ValueError) as error:
            raise InvalidArgumentError(
                f"KvplugConnector: host_memory must be bytes or a size like \"4GiB\", got {extra['host_memory']!r}: "
                f"{error}") from error
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
    if host_memory is not None and "host_memory" in options:
        raise InvalidArgumentError("KvplugConnector: give host_memory once, not also in prefix_cache_options")
    policy = extra.get("on_cache_failure", "fallback")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise InvalidArgumentError(
            f"KvplugConnector: on_cache_failure must be one of {list(POLICIES)}, got {policy!r}")
    return KvplugSettings(prefix_cache=name, prefix_cache_options=options, host_memory=host_memory,
                          on_cache_failure=policy)
