"""``InheritedPrefixes``: the locked prefixes of running requests, kept across a prefix-cache hand-over.

When a ``KVBackend`` replaces its prefix cache (``kvplug.cache_guard.hand_over``: the old one
faulted, or ``reset_prefix_cache``), running requests still read K/V through the prefixes they
locked. Those pages cannot simply become each request's own: requests that matched the same
prefix share its pages, and a page has one owner. Nor can the new cache index them (it would have
to be told the prefixes' tokens, and ``naive`` keeps nothing). So this layer, in front of the new
cache, holds them: each request's prefix pages, locked once per request (so shared pages are
counted), not matchable, and evictable once the last request holding them is done. The backend
sees one cache whose ``size_info`` includes them; they return to the free list through ``evict``
as any cached page does, and the accounting stays whole (``check_integrity``).

What a request holding an inherited prefix inserts when it finishes (or between chunks) starts
with an inherited page: the layer keeps that whole insert as inherited pages (reported as nothing
cached before, so the allocator frees nothing it still uses); every other call goes to the new cache.
Inherited pages are evicted before the new cache's (no request can match them again).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvplug.interface import BaseCacheHandle, BasePrefixCache, InsertResult, InvalidArgumentError, MatchResult, SizeInfo


class InheritedHandle(BaseCacheHandle):
    """A running request's prefix held by ``InheritedPrefixes``.

    Attributes:
        pages: shape ``[cached_len / page_size]``, int64, host; its page numbers.
    """

    def __init__(self, owner: "InheritedPrefixes", indices: torch.Tensor, pages: np.ndarray) -> None:
        self.owner = owner
        self.cached_len = int(indices.shape[0])
        self._indices = indices
        self.pages = pages

    def get_matched_indices(self) -> torch.Tensor:
        """shape ``[cached_len]``, int32, the cache's device."""
        return self._indices


class InheritedPrefixes(BasePrefixCache):
    """``inner`` (the new cache) plus the inherited prefixes (see the module docstring).

    Args:
        inner: the cache that takes over, empty.
        num_pages: pages of the KV pool.
        page_size: tokens per page.
    """

    trusted = True  # kvplug's own

    def __init__(self, inner: BasePrefixCache, *, num_pages: int, page_size: int) -> None:
        self.inner = inner
        self.page_size = page_size
        self.device = getattr(inner, "device", torch.device("cpu"))
        self._locks = np.zeros(num_pages, dtype=np.int64)
        self._held = np.zeros(num_pages, dtype=bool)
        self._unlocked: dict[int, None] = {}  # held pages no request locks (an ordered set)
        self._held_pages = 0
        self._locked_pages = 0

    def __repr__(self) -> str:
        return f"InheritedPrefixes({self._held_pages} inherited pages over {self.inner!r})"

    # ------------------------------------------------------------------ the hand-over
    def inherit(self, indices: torch.Tensor) -> InheritedHandle:
        """Hold a running request's prefix (``indices``: shape ``[n]``, int32, whole pages) and
        return its handle, locked once."""
        handle = self._handle(indices)
        self._hold(handle.pages)
        self.lock_handle(handle)
        return handle

    def _handle(self, indices: torch.Tensor) -> InheritedHandle:
        locations = indices.detach().cpu().numpy().astype(np.int64)
        pages = locations[:: self.page_size] // self.page_size
        return InheritedHandle(self, indices.detach().cpu().to(torch.int32).clone(), pages)

    def _hold(self, pages: np.ndarray) -> None:
        new = pages[~self._held[pages]]
        self._held[new] = True
        self._held_pages += int(new.size)
        for page in new.tolist():
            self._unlocked[page] = None

    @property
    def inherited_pages(self) -> int:
        return self._held_pages

    # ------------------------------------------------------------------ BasePrefixCache
    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        return self.inner.match_prefix(input_ids)

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        if not isinstance(handle, InheritedHandle):
            self.inner.lock_handle(handle, unlock)
            return
        if handle.owner is not self:
            raise InvalidArgumentError(f"expected a handle from this cache, got {handle!r}")
        pages, locks = handle.pages, self._locks
        if unlock:
            if pages.size and not locks[pages].all():
                raise InvalidArgumentError(f"unlocking an inherited prefix of {handle.cached_len} tokens that holds no lock")
            locks[pages] -= 1
            freed = pages[locks[pages] == 0]
            self._locked_pages -= int(freed.size)
            for page in freed.tolist():
                self._unlocked[page] = None
        else:
            fresh = pages[locks[pages] == 0]
            self._locked_pages += int(fresh.size)
            for page in fresh.tolist():
                self._unlocked.pop(page, None)
            locks[pages] += 1

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        size = self.page_size
        if indices.shape[0] and self._held[int(indices[0]) // size]:  # a request with an inherited prefix
            handle = self._handle(indices)
            self._hold(handle.pages)
            return InsertResult(0, handle)
        return self.inner.insert_prefix(input_ids, indices)

    def evict(self, size: int) -> torch.Tensor:
        page_size = self.page_size
        taken = []
        while self._unlocked and len(taken) * page_size < size:
            page = next(iter(self._unlocked))
            del self._unlocked[page]
            taken.append(page)
        if taken:
            pages = np.array(taken, dtype=np.int64)
            self._held[pages] = False
            self._held_pages -= pages.size
        rest = size - len(taken) * page_size
        own = torch.from_numpy((np.array(taken, dtype=np.int64)[:, None] * page_size
                                + np.arange(page_size)).reshape(-1).astype(np.int32))
        if rest <= 0:
            return own if self.device.type == "cpu" else own.to(self.device)
        evicted = self.inner.evict(rest)
        return torch.cat([own.to(evicted.device), evicted]) if taken else evicted

    def reset(self) -> None:
        self.inner.reset()
        self._locks[:] = 0
        self._held[:] = False
        self._unlocked.clear()
        self._held_pages = self._locked_pages = 0

    @property
    def size_info(self) -> SizeInfo:
        inner = self.inner.size_info
        size = self.page_size
        locked, held = self._locked_pages * size, self._held_pages * size
        return SizeInfo(inner.evictable_size + held - locked, inner.protected_size + locked)

    @property
    def tracked_size_info(self) -> SizeInfo:
        """``size_info`` without a call into a checked plugin (``CheckedPrefixCache.tracked_size_info``)."""
        tracked = getattr(self.inner, "tracked_size_info", None)
        inner = tracked if tracked is not None else self.inner.size_info
        size = self.page_size
        locked, held = self._locked_pages * size, self._held_pages * size
        return SizeInfo(inner.evictable_size + held - locked, inner.protected_size + locked)

    def check_integrity(self) -> None:
        self.inner.check_integrity()
        assert int(self._held.sum()) == self._held_pages, "inherited prefixes: held page count drifted"
        assert int(np.count_nonzero(self._locks)) == self._locked_pages, "inherited prefixes: locked count drifted"
        assert not (self._locks.astype(bool) & ~self._held).any(), "inherited prefixes: a locked page not held"
        unlocked = np.flatnonzero(self._held & (self._locks == 0))
        assert sorted(self._unlocked) == unlocked.tolist(), "inherited prefixes: evictable pages drifted"

    # ------------------------------------------------------------------ KV events: the new cache's
    @property
    def publishes_kv_events(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.inner, "publishes_kv_events", False))

    def add_kv_event_listener(self, listener: Any) -> bool:
        return self.inner.add_kv_event_listener(listener)

    def remove_kv_event_listener(self, listener: Any) -> None:
        self.inner.remove_kv_event_listener(listener)

    @property
    def kv_event_listeners(self) -> tuple:
        return tuple(getattr(self.inner, "kv_event_listeners", ()))

    @property
    def has_kv_event_listeners(self) -> bool:
        return bool(getattr(self.inner, "has_kv_event_listeners", False))
