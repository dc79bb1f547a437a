"""``Version1Cache``: a prefix-cache plugin as written for interface version 1, before KV cache
events existed: it implements the seven abstract members (delegating to ``radix``) and nothing
else, so tests can check that such plugins keep working."""

from __future__ import annotations

import kvplug


class Version1Cache(kvplug.BasePrefixCache):
    """A version-1 prefix cache: the abstract members only, each delegated to a ``radix`` cache."""

    def __init__(self, config: kvplug.PrefixCacheConfig) -> None:
        self.inner = kvplug.create_prefix_cache("radix", page_size=config.page_size)

    def match_prefix(self, input_ids):
        return self.inner.match_prefix(input_ids)

    def lock_handle(self, handle, unlock=False):
        self.inner.lock_handle(handle, unlock)

    def insert_prefix(self, input_ids, indices):
        return self.inner.insert_prefix(input_ids, indices)

    def evict(self, size):
        return self.inner.evict(size)

    def reset(self):
        self.inner.reset()

    @property
    def size_info(self):
        return self.inner.size_info

    def check_integrity(self):
        self.inner.check_integrity()
