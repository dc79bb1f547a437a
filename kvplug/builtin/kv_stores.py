"""Built-in plugin: the ``redis``, ``mooncake`` and ``memory`` shared KV stores (issue 30)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.hookspecs import hookimpl

if TYPE_CHECKING:  # loading the built-ins imports no store module
    from kvplug.interface import BaseKVStore, KVStoreConfig


def create_redis(config: KVStoreConfig) -> BaseKVStore:
    from kvplug.kv_store.redis_store import RedisKVStore

    return RedisKVStore(config)


def create_mooncake(config: KVStoreConfig) -> BaseKVStore:
    from kvplug.kv_store.mooncake_store import MooncakeKVStore

    return MooncakeKVStore(config)


def create_memory(config: KVStoreConfig) -> BaseKVStore:
    from kvplug.kv_store.memory_store import InMemoryKVStore

    return InMemoryKVStore(config)


@hookimpl
def kvplug_register_kv_stores(register):
    register("redis", create_redis)
    register("mooncake", create_mooncake)
    register("memory", create_memory)
