"""kvplug: the KV-cache subsystem of an LLM serving engine, shipped as a plugin.

The names exported here are the public contract, version 1 (SPEC §3). The module-level helpers
use a lazily built default ``PluginManager``; pass ``manager=`` (or build your own
``kvplug.PluginManager``) to keep hosts and tests isolated from it.
"""

from __future__ import annotations

from typing import Any

from kvplug._version import __version__
from kvplug.backend import BackendStats, KVBackend, ModelShape, Request, create_backend
from kvplug.hookspecs import hookimpl
from kvplug.interface import (
    INTERFACE_VERSION,
    AttentionBatch,
    AttentionConfig,
    BaseAttentionBackend,
    BaseCacheHandle,
    BaseKVPool,
    BasePrefixCache,
    DuplicateComponentError,
    ForwardPhase,
    InsertResult,
    InvalidArgumentError,
    KVPlugError,
    KVPoolConfig,
    MatchResult,
    OutOfMemoryError,
    PluginLoadError,
    PluginRegistrationError,
    PrefixCacheConfig,
    SizeInfo,
    UnknownComponentError,
)
from kvplug.plugins import PluginManager, default_manager, reset_default_manager


def available(kind: str, *, manager: PluginManager | None = None) -> list[str]:
    """Names registered for ``kind``: ``"prefix_cache"``, ``"kv_pool"``, ``"attention"`` or ``"host"``."""
    return (manager or default_manager()).available(kind)


def create_prefix_cache(
    name: str, *, device: Any = "cpu", page_size: int = 1, manager: PluginManager | None = None, **options: Any
) -> BasePrefixCache:
    """Build a prefix cache by name; ``options`` reach the factory as ``config.options``."""
    return (manager or default_manager()).create_prefix_cache(name, device=device, page_size=page_size, **options)


def create_kv_pool(name: str, config: KVPoolConfig, *, manager: PluginManager | None = None) -> BaseKVPool:
    """Build a KV pool by name (``"mha"``)."""
    return (manager or default_manager()).create_kv_pool(name, config)


def create_attention_backend(
    name: str, config: AttentionConfig, *, manager: PluginManager | None = None
) -> BaseAttentionBackend:
    """Build an attention backend by name (``"torch"``, ``"triton"``, ``"flashinfer"``, ``"fa3"``, ``"P,D"``)."""
    return (manager or default_manager()).create_attention_backend(name, config)


def __getattr__(name: str) -> Any:
    # ``import kvplug; kvplug.testing.check_prefix_cache(...)``: the conformance kit loads on first use
    if name == "testing":
        import importlib

        return importlib.import_module("kvplug.testing")
    raise AttributeError(f"module 'kvplug' has no attribute {name!r}")


__all__ = [
    "BackendStats",
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
    "DuplicateComponentError",
    "ForwardPhase",
    "InsertResult",
    "InvalidArgumentError",
    "KVPlugError",
    "KVPoolConfig",
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
