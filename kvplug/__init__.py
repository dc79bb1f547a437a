"""kvplug: the KV-cache subsystem of an LLM serving engine, shipped as a plugin.

The names exported here are the public contract, version 1 (docs/design.md, "The public
contract"). The module-level helpers use a lazily built default ``PluginManager``; pass
``manager=`` (or build your own ``kvplug.PluginManager``) to keep hosts and tests isolated from it.

Names are imported on first use (a module ``__getattr__``), so ``import kvplug`` and commands that
need no tensors (``kvplug --version``, a plugin module doing ``from kvplug import hookimpl``) do
not import torch. ``from kvplug import X`` works as before for every name in ``__all__``, and
every sub-package is reachable as an attribute (``kvplug.testing``, ``kvplug.memory``, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvplug._version import __version__
from kvplug.lazy_names import lazy_attributes

if TYPE_CHECKING:
    from kvplug.backend import BackendStats, KVBackend, ModelShape, Request, create_backend
    from kvplug.decode_step import DecodeGraphs
    from kvplug.decode_step import DecodeStep
    from kvplug.hookspecs import hookimpl
    from kvplug.interface import (
        INTERFACE_VERSION,
        AttentionBatch,
        AttentionConfig,
        BaseAttentionBackend,
        BaseCacheHandle,
        BaseKVPool,
        BasePrefixCache,
        BaseKVStore,
        BaseTieredPrefixCache,
        CacheOwnedError,
        ConcurrentUseError,
        DuplicateComponentError,
        ForwardPhase,
        InsertResult,
        InvalidArgumentError,
        KVPlugError,
        KVPoolConfig,
        KVStoreConfig,
        KVStoreError,
        MatchResult,
        OutOfMemoryError,
        PluginLoadError,
        PluginRegistrationError,
        PrefixCacheConfig,
        PrefixCacheFault,
        SizeInfo,
        TierCopyError,
        TieredMatchResult,
        TierStats,
        UnknownComponentError,
    )
    from kvplug.plugins import PluginManager, default_manager, reset_default_manager

# public name -> the module that defines it, imported on first access
_LAZY_NAMES: dict[str, str] = {
    "BackendStats": "kvplug.backend",
    "KVBackend": "kvplug.backend",
    "ModelShape": "kvplug.backend",
    "Request": "kvplug.backend",
    "create_backend": "kvplug.backend",
    "DecodeStep": "kvplug.decode_step",
    "DecodeGraphs": "kvplug.decode_step",
    "hookimpl": "kvplug.hookspecs",
    "INTERFACE_VERSION": "kvplug.interface",
    "AttentionBatch": "kvplug.interface",
    "AttentionConfig": "kvplug.interface",
    "BaseAttentionBackend": "kvplug.interface",
    "BaseCacheHandle": "kvplug.interface",
    "BaseKVPool": "kvplug.interface",
    "BasePrefixCache": "kvplug.interface",
    "BaseTieredPrefixCache": "kvplug.interface",
    "TierCopyError": "kvplug.interface",
    "CacheOwnedError": "kvplug.interface",  # issue 32
    "ConcurrentUseError": "kvplug.interface",  # issue 32
    "PrefixCacheFault": "kvplug.interface",  # issue 32
    "TierStats": "kvplug.interface",
    "BaseKVStore": "kvplug.interface",  # issue 30
    "KVStoreConfig": "kvplug.interface",  # issue 30
    "KVStoreError": "kvplug.interface",  # issue 30
    "TieredMatchResult": "kvplug.interface",
    "DuplicateComponentError": "kvplug.interface",
    "ForwardPhase": "kvplug.interface",
    "InsertResult": "kvplug.interface",
    "InvalidArgumentError": "kvplug.interface",
    "KVPlugError": "kvplug.interface",
    "KVPoolConfig": "kvplug.interface",
    "MatchResult": "kvplug.interface",
    "OutOfMemoryError": "kvplug.interface",
    "PluginLoadError": "kvplug.interface",
    "PluginRegistrationError": "kvplug.interface",
    "PrefixCacheConfig": "kvplug.interface",
    "SizeInfo": "kvplug.interface",
    "UnknownComponentError": "kvplug.interface",
    "PluginManager": "kvplug.plugins",
    "default_manager": "kvplug.plugins",
    "reset_default_manager": "kvplug.plugins",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY_NAMES, submodules=True)


def available(kind: str, *, manager: PluginManager | None = None) -> list[str]:
    """Names registered for ``kind``: ``"prefix_cache"``, ``"kv_pool"``, ``"attention"``, ``"host"`` or ``"kv_store"``."""
    from kvplug.plugins import default_manager

    return (manager or default_manager()).available(kind)


def create_prefix_cache(
    name: str, *, device: Any = "cpu", page_size: int = 1, manager: PluginManager | None = None, **options: Any
) -> BasePrefixCache:
    """Build a prefix cache by name; ``options`` reach the factory as ``config.options``."""
    from kvplug.plugins import default_manager

    return (manager or default_manager()).create_prefix_cache(name, device=device, page_size=page_size, **options)


def create_kv_pool(name: str, config: KVPoolConfig, *, manager: PluginManager | None = None) -> BaseKVPool:
    """Build a KV pool by name (``"mha"``)."""
    from kvplug.plugins import default_manager

    return (manager or default_manager()).create_kv_pool(name, config)


def create_attention_backend(
    name: str, config: AttentionConfig, *, manager: PluginManager | None = None
) -> BaseAttentionBackend:
    """Build an attention backend by name (``"torch"``, ``"triton"``, ``"flashinfer"``, ``"fa3"``, ``"P,D"``)."""
    from kvplug.plugins import default_manager

    return (manager or default_manager()).create_attention_backend(name, config)


__all__ = [
    "BackendStats",
    "DecodeGraphs",
    "DecodeStep",
    "KVBackend",
    "ModelShape",
    "Request",
    "create_backend",
    "INTERFACE_VERSION",
    "AttentionBatch",
    "AttentionConfig",
    "BaseAttentionBackend",
    "BaseCacheHandle",
    "BaseKVPool",
    "BasePrefixCache",
    "BaseKVStore",
    "BaseTieredPrefixCache",
    "TierCopyError",
    "CacheOwnedError",
    "ConcurrentUseError",
    "PrefixCacheFault",
    "TierStats",
    "TieredMatchResult",
    "DuplicateComponentError",
    "ForwardPhase",
    "InsertResult",
    "InvalidArgumentError",
    "KVPlugError",
    "KVPoolConfig",
    "KVStoreConfig",
    "KVStoreError",
    "MatchResult",
    "OutOfMemoryError",
    "PluginLoadError",
    "PluginManager",
    "PluginRegistrationError",
    "PrefixCacheConfig",
    "SizeInfo",
    "UnknownComponentError",
    "__version__",
    "available",
    "create_attention_backend",
    "create_kv_pool",
    "create_prefix_cache",
    "default_manager",
    "hookimpl",
    "reset_default_manager",
]
