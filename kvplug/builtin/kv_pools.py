"""Built-in plugin: the ``mha`` KV pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.hookspecs import hookimpl

if TYPE_CHECKING:  # loading the built-ins must not import the tensor types (kvplug plugins stays fast)
    from kvplug.interface import BaseKVPool, KVPoolConfig


def create_mha(config: KVPoolConfig) -> BaseKVPool:
    from kvplug.memory.mha_pool import MHAKVPool

    return MHAKVPool(config)


@hookimpl
def kvplug_register_kv_pools(register):
    register("mha", create_mha)
