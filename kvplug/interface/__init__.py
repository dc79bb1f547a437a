"""The public contract: abstract base classes, result types and errors (docs/design.md, section 3).

The error types and ``INTERFACE_VERSION`` import nothing heavy; the ABCs, configs and event
types, whose modules import torch, are imported on first access, so that code that only loads
plugins or handles kvplug's errors (``kvplug plugins``, a host's CLI) does not import torch.
"""

import importlib
from typing import Any

from kvplug.interface.errors import (
    DuplicateComponentError,
    InvalidArgumentError,
    KVPlugError,
    OutOfMemoryError,
    PluginLoadError,
    PluginRegistrationError,
    UnknownComponentError,
)

# names whose modules import torch, imported on first access
_LAZY_NAMES = {
    **dict.fromkeys(("AttentionBatch", "AttentionConfig", "BaseAttentionBackend", "ForwardPhase"),
                    "kvplug.interface.attention"),
    **dict.fromkeys(("SUPPORTED_KV_DTYPES", "BaseKVPool", "KVPoolConfig"), "kvplug.interface.kv_pool"),
    **dict.fromkeys(("KV_MEDIUM_DEVICE", "AllCleared", "BaseCacheHandle", "BasePrefixCache", "BlockRemoved",
                     "BlockStored", "InsertResult", "KVCacheEvent", "KVEventListener", "MatchResult",
                     "PrefixCacheConfig", "SizeInfo"), "kvplug.interface.prefix_cache"),
}


def __getattr__(name: str) -> Any:
    """Import a name whose module needs torch (or a submodule) on first access."""
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    elif name in ("attention", "kv_pool", "prefix_cache"):
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


INTERFACE_VERSION = 1

__all__ = [
    "INTERFACE_VERSION",
    "KV_MEDIUM_DEVICE",
    "AllCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEventListener",
    "AttentionBatch",
    "AttentionConfig",
    "BaseAttentionBackend",
    "BaseCacheHandle",
    "BaseKVPool",
    "BasePrefixCache",
    "DuplicateComponentError",
    "ForwardPhase",
    "InsertResult",
    "InvalidArgumentError",
    "KVPlugError",
    "KVPoolConfig",
    "MatchResult",
    "OutOfMemoryError",
    "PluginLoadError",
    "PluginRegistrationError",
    "PrefixCacheConfig",
    "SUPPORTED_KV_DTYPES",
    "SizeInfo",
    "UnknownComponentError",
]
