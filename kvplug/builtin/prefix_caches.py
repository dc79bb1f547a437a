"""Built-in plugin: the ``naive`` and ``radix`` prefix caches."""

from __future__ import annotations

from kvplug.hookspecs import hookimpl
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
