"""SGLang's ``RadixCache`` as a benchmark anchor, driven through its public API.

Only importable where SGLang is (e.g. the venv built by ``shared/anchors/sglang-radix-venv.sh``):
``RadixCache.create_simulated`` with a null allocator, ``RadixKey(array("q", ids))`` keys and int64
value tensors, and the ``MatchPrefixParams`` / ``InsertParams`` / ``EvictParams`` objects, all
built by ``prepare`` outside the timed region. Nothing of SGLang is copied here, only called.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import torch

from kvplug.bench.prefix_cache_drivers import CacheDriver


def sglang_status() -> tuple[str | None, str | None]:
    """``(version, None)`` when SGLang's RadixCache imports, else ``(None, why not)``."""
    try:
        from importlib import import_module
        from importlib.metadata import version

        import_module("sglang.srt.mem_cache.radix_cache").RadixCache  # noqa: B018 (the import is the check)
        return version("sglang"), None
    except Exception as error:  # any failure means "no anchor in this environment"
        return None, f"{type(error).__name__}: {error}"


class _NullAllocator:
    """Stands in for SGLang's KV allocator: eviction hands it the freed values, which it drops."""

    device = torch.device("cpu")

    def free_segment(self, values: torch.Tensor, start_pos: int = 0) -> None:
        pass


class SGLangRadixDriver(CacheDriver):
    """SGLang's RadixCache with the calls its scheduler makes (match, inc/dec lock ref, insert, evict)."""

    def __init__(self, page_size: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self.name = "sglang-radix"
        self._radix_key, self._match_params, self._insert_params = RadixKey, MatchPrefixParams, InsertParams
        self._evict_params = EvictParams
        self.cache = RadixCache.create_simulated(mock_allocator=_NullAllocator(), page_size=page_size)

    def prepare(self, token_ids: np.ndarray, locations: np.ndarray) -> tuple[Any, Any]:
        key = self._radix_key(array("q", token_ids.astype(np.int64).tobytes()))
        values = torch.from_numpy(locations.astype(np.int64))
        return self._match_params(key=key), self._insert_params(key=key, value=values)

    def match_lock(self, item: tuple[Any, Any]) -> Any:
        result = self.cache.match_prefix(item[0])
        self.cache.inc_lock_ref(result.last_device_node)
        return result

    def matched_indices(self, matched: Any) -> torch.Tensor:
        return self.cache.path_device_indices(matched.last_device_node)

    def cached_len(self, matched: Any) -> int:
        return matched.device_prefix_len

    def insert(self, item: tuple[Any, Any]) -> Any:
        return self.cache.insert(item[1])

    def unlock(self, matched: Any) -> None:
        self.cache.dec_lock_ref(matched.last_device_node)

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(self._evict_params(num_tokens=num_tokens)).num_tokens_evicted

    def total_tokens(self) -> int:
        return self.cache.evictable_size() + self.cache.protected_size()
