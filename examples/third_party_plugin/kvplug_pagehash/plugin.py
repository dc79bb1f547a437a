"""The entry-point module: kvplug calls these hooks and gets the factories by name.

kvplug loads this module and calls its hook for every ``kvplug`` command (``kvplug plugins``
included), so it imports neither torch nor the cache: the factory imports them when a cache is built.
"""

import kvplug


def create_page_hash(config):
    """``factory(config) -> BasePrefixCache``: the import (and torch with it) happens here, on first use."""
    from kvplug_pagehash.cache import PageHashPrefixCache

    return PageHashPrefixCache(config)


def create_directory_store(config):
    """``factory(config) -> BaseKVStore`` for ``dir:///PATH`` URLs (imported on first use too)."""
    from kvplug_pagehash.directory_store import DirectoryKVStore

    return DirectoryKVStore(config)


@kvplug.hookimpl
def kvplug_register_prefix_caches(register):
    register("page-hash", create_page_hash)


@kvplug.hookimpl
def kvplug_register_kv_stores(register):
    register("dir", create_directory_store)
