"""The public contract: abstract base classes, result types and errors (SPEC §3)."""

from kvplug.interface.attention import AttentionBatch, AttentionConfig, BaseAttentionBackend, ForwardPhase
from kvplug.interface.errors import (
    DuplicateComponentError,
    InvalidArgumentError,
    KVPlugError,
    OutOfMemoryError,
    PluginLoadError,
    PluginRegistrationError,
    UnknownComponentError,
)
from kvplug.interface.kv_pool import SUPPORTED_KV_DTYPES, BaseKVPool, KVPoolConfig
from kvplug.interface.prefix_cache import (
    KV_MEDIUM_DEVICE,
    AllCleared,
    BaseCacheHandle,
    BasePrefixCache,
    BlockRemoved,
    BlockStored,
    InsertResult,
    KVCacheEvent,
    KVEventListener,
    MatchResult,
    PrefixCacheConfig,
    SizeInfo,
)

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
