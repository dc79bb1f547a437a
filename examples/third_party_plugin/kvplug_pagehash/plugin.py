"""The entry-point module: kvplug calls this hook and gets the factory by name.

kvplug loads this module and calls its hook for every ``kvplug`` command (``kvplug plugins``
included), so it imports neither torch nor the cache: the factory imports them when a cache is built.
"""

import kvplug


def create_page_hash(config):
    """``factory(config) -> BasePrefixCache``: the import (and torch with it) happens here, on first use."""
    from kvplug_pagehash.cache import PageHashPrefixCache

    return PageHashPrefixCache(config)


@kvplug.hookimpl
def kvplug_register_prefix_caches(register):
    register("page-hash", create_page_hash)
