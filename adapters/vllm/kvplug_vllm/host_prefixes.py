"""Host hits in vLLM's scheduler: a prefix kvplug wrote back to host memory, loaded into new blocks.

With ``host_memory`` each namespace's cache is the tiered radix tree; its host tier shares one
``RecordedHostPool`` (one host budget for all namespaces). Evicting device blocks
(``BlockPrefixCache.evict_blocks``) makes the tree write them back: recorded copies. At admission,
through vLLM's connector calls:

- ``match`` (``get_num_new_matched_tokens``): the host-resident continuation of the request's
  device hit, in whole blocks and capped as the device hit is (the last token is recomputed); it
  is locked so making room for the request cannot drop it. vLLM counts these tokens as external.
- ``load`` (``update_state_after_alloc``): vLLM allocated blocks for them; the tree loads the host
  pages into those blocks (a recorded copy), the blocks become kvplug's cached blocks (kvplug's
  reference on each) and the request's lock moves onto the whole prefix.
- ``forget`` (the request leaves while waiting): the host lock is released.

The worker makes the recorded copies before the step's forward (``connector``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from kvplug.interface import BaseCacheHandle, InvalidArgumentError

from kvplug_vllm.block_cache import BlockMatch, BlockPrefixCache, CacheSpace
from kvplug_vllm.host_copies import RecordedHostPool
from kvplug_vllm.namespaces import namespace_of
from kvplug_vllm.prefix_caching import RequestPrefixes


class HostMatch(NamedTuple):
    """A locked host-resident continuation: ``host_tokens`` after ``device_tokens`` device tokens."""

    space: CacheSpace
    host_handle: BaseCacheHandle
    device_tokens: int
    host_tokens: int


class HostPrefixes:
    """The host-hit side of the scheduler (see the module docstring)."""

    def __init__(self, cache: BlockPrefixCache, prefixes: RequestPrefixes, pool: RecordedHostPool) -> None:
        self.cache = cache
        self.prefixes = prefixes
        self.pool = pool
        self._pending: dict[str, HostMatch] = {}
        self.host_hit_tokens = 0
        self.host_hits = 0

    def match(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens after the request's device hit of ``num_computed_tokens`` that host memory holds."""
        self.forget(request.request_id)
        block_size = self.cache.block_size
        length = max(request.num_tokens - 1, 0) // block_size * block_size
        if length <= num_computed_tokens:
            return 0
        space = self.cache.space(namespace_of(request))
        ids = torch.tensor(request.all_token_ids[:length], dtype=torch.int32)
        found = space.cache.match_tiered(ids)
        if found.host_len == 0 or found.handle.cached_len != num_computed_tokens:
            return 0  # nothing on host, or vLLM's device hit is not the tree's device head: no load
        space.cache.lock_handle(found.host_handle)
        self._pending[request.request_id] = HostMatch(space, found.host_handle, num_computed_tokens, found.host_len)
        return found.host_len

    def load(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks) with ``num_external_tokens`` to load."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None:
            if num_external_tokens:
                raise InvalidArgumentError(
                    f"vLLM admitted request {request.request_id!r} with {num_external_tokens} external tokens "
                    "that kvplug's host tier did not report")
            return
        space = pending.space
        if num_external_tokens == 0:  # vLLM dropped the load (skip_reading_prefix_cache)
            space.cache.lock_handle(pending.host_handle, unlock=True)
            return
        if num_external_tokens != pending.host_tokens:
            space.cache.lock_handle(pending.host_handle, unlock=True)
            raise InvalidArgumentError(
                f"vLLM admitted request {request.request_id!r} with {num_external_tokens} external tokens, "
                f"kvplug's host tier reported {pending.host_tokens}")
        block_size = self.cache.block_size
        first = pending.device_tokens // block_size
        targets = list(block_ids[first: first + pending.host_tokens // block_size])
        blocks = torch.tensor(targets, dtype=torch.int32)
        locations = (blocks[:, None] * block_size + torch.arange(block_size, dtype=torch.int32)).reshape(-1)
        handle = space.cache.load_host_prefix(pending.host_handle, locations)
        self.cache.adopt_loaded(targets)
        space.cache.lock_handle(handle)
        space.cache.lock_handle(pending.host_handle, unlock=True)
        total = pending.device_tokens + pending.host_tokens
        self.prefixes.hold(request, BlockMatch(space, handle, total, tuple(block_ids[: total // block_size]), space.cache))
        self.host_hits += 1
        self.host_hit_tokens += pending.host_tokens

    def forget(self, request_id: str) -> None:
        """Release a waiting request's host lock (it is asked again, or it left)."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            try:
                pending.space.cache.lock_handle(pending.host_handle, unlock=True)
            except InvalidArgumentError:
                pass  # the cache was reset since: the handle and its lock are gone with the tree

    def reset(self) -> None:
        """The caches were reset: their handles (and locks) are gone."""
        self._pending.clear()

    def snapshot(self) -> dict[str, int]:
        pool = self.pool
        return {"host_pages": pool.num_pages, "host_free_pages": pool.num_free_pages,
                "host_hits": self.host_hits, "host_hit_tokens": self.host_hit_tokens}
