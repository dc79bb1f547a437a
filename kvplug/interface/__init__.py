"""The public contract: abstract base classes, result types and errors (docs/design.md, section 3).

The error types and ``INTERFACE_VERSION`` import nothing heavy; the ABCs, configs and event
types, whose modules import torch, are imported on first access, so that code that only loads
plugins or handles kvplug's errors (``kvplug plugins``, a host's CLI) does not import torch.
"""

from kvplug.interface.errors import (
    CacheOwnedError,
    ConcurrentUseError,
    DeferredWorkError,
    DuplicateComponentError,
    InvalidArgumentError,
    KVPlugError,
    KVStoreError,
    OutOfMemoryError,
    PluginLoadError,
    PluginRegistrationError,
    PrefixCacheFault,
    TierCopyError,
    UnknownComponentError,
)
from kvplug.lazy_names import lazy_attributes

# names whose modules import torch, imported on first access
_LAZY_NAMES = {
    **dict.fromkeys(("AttentionBatch", "AttentionConfig", "BaseAttentionBackend", "ForwardPhase"),
                    "kvplug.interface.attention"),
    **dict.fromkeys(("SUPPORTED_KV_DTYPES", "BaseKVPool", "KVPoolConfig"), "kvplug.interface.kv_pool"),
    **dict.fromkeys(("KV_MEDIUM_DEVICE", "AllCleared", "BaseCacheHandle", "BasePrefixCache", "BlockRemoved",
                     "BlockStored", "InsertResult", "KVCacheEvent", "KVEventListener", "MatchResult",
                     "PrefixCacheConfig", "SizeInfo"), "kvplug.interface.prefix_cache"),
    **dict.fromkeys(("BaseKVStore", "KVStoreConfig"), "kvplug.interface.kv_store"),  # issue 30
    **dict.fromkeys(("KV_MEDIUM_HOST", "BaseTieredPrefixCache", "CopyDone", "HostLoad", "TieredMatchResult",
                     "TierStats"),
                    "kvplug.interface.tiered_cache"),
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY_NAMES, submodules=("attention", "kv_pool", "kv_store", "prefix_cache", "tiered_cache"))


INTERFACE_VERSION = 1

__all__ = [
    "INTERFACE_VERSION",
    "KV_MEDIUM_DEVICE",
    "KV_MEDIUM_HOST",
    "BaseTieredPrefixCache",
    "CacheOwnedError",
    "ConcurrentUseError",
    "DeferredWorkError",
    "PrefixCacheFault",
    "CopyDone",
    "HostLoad",
    "TierCopyError",
    "TierStats",
    "TieredMatchResult",
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
    "BaseKVStore",
    "KVStoreConfig",
    "KVStoreError",
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
