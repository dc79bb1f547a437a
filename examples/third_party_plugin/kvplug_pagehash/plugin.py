"""The entry-point module: kvplug calls this hook and gets the factory by name."""

import kvplug


@kvplug.hookimpl
def kvplug_register_prefix_caches(register):
    from kvplug_pagehash.cache import PageHashPrefixCache

    register("page-hash", PageHashPrefixCache)
