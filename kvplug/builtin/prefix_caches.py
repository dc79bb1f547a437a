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
    """``radix``; with the option ``host_memory`` (bytes or ``"32GiB"``) the tiered radix cache,
    which keeps evicted prefixes in host memory (``kvplug.prefix_cache.tiered_radix``)."""
    if config.options.get("host_memory") is not None:
        from kvplug.prefix_cache.tiered_radix import TieredRadixPrefixCache

        return TieredRadixPrefixCache(config)
    import dataclasses

    from kvplug.prefix_cache.radix import RadixPrefixCache

    if config.options.get("remote_kv") is not None:
        from kvplug.interface import InvalidArgumentError

        raise InvalidArgumentError("remote_kv (a shared KV store, issue 30) sits under the host tier: give host_memory too")

    if "host_memory" in config.options:  # host_memory=None: no tier (lets hosts pass it through)
        options = {key: value for key, value in config.options.items() if key != "host_memory"}
        config = dataclasses.replace(config, options=options)
    return RadixPrefixCache(config)


@hookimpl
def kvplug_register_prefix_caches(register):
    register("naive", create_naive)
    register("radix", create_radix)
