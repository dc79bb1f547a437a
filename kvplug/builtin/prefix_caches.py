"""Built-in plugin: the ``naive`` and ``radix`` prefix caches."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.hookspecs import hookimpl

if TYPE_CHECKING:  # loading the built-ins must not import the tensor types (kvplug plugins stays fast)
    from kvplug.interface import BasePrefixCache, PrefixCacheConfig


def create_naive(config: PrefixCacheConfig) -> BasePrefixCache:
    from kvplug.prefix_cache.naive import NaivePrefixCache

    return NaivePrefixCache(config)


def create_radix(config: PrefixCacheConfig) -> BasePrefixCache:
    from kvplug.prefix_cache.radix import RadixPrefixCache

    return RadixPrefixCache(config)


@hookimpl
def kvplug_register_prefix_caches(register):
    register("naive", create_naive)
    register("radix", create_radix)
