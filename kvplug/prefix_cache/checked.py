"""``CheckedPrefixCache``: every answer of an untrusted prefix cache checked where kvplug receives it.

A ``KVBackend`` wraps each prefix cache that does not declare itself ``trusted`` (the built-ins do)
in this class, so a plugin that raises or answers outside the contract cannot corrupt the pool: a
location outside it or twice would have two requests write one page's K/V, a short eviction or a
wrong ``cached_len`` would leak pages. Nothing the plugin returns is used before it is checked, and
a violation, or any exception from the plugin, raises ``PrefixCacheFault`` naming the plugin, the
method and what it did (the backend then replaces the cache: ``kvplug.cache_guard``).

The wrapper knows every location the cache was given and every lock taken, because all of them
pass through it: ``insert_prefix`` hands pages over, ``evict`` and ``reset`` take them back,
``lock_handle`` protects a handle's pages. So it checks, at a cost proportional to the answer
(never the pool), that

- a match's locations are ones the cache holds: inside the pool ``[0, num_pages * page_size)``,
  whole pages (``start .. start + P - 1``, ``start`` a multiple of P), distinct, and
  ``cached_len == len(get_matched_indices())``, page-aligned, at most the query's length;
- an insert's ``cached_len`` lies in ``[0, len(input_ids)]``, page-aligned; its handle covers the
  whole input, keeps the given locations past ``cached_len`` and cached ones before it;
- an eviction is a 1-D int32 tensor of at least the tokens asked, whole pages, distinct, inside the
  pool, of pages the cache holds and no handle locks;
- ``size_info`` totals what the cache holds and overstates neither evictable nor protected tokens
  (checked after every insert and evict too).

The arguments kvplug passes are checked more lightly (types, lengths, and that each inserted page
starts a page, inside the pool, once: the allocator hands out whole pages); a bad one raises
``InvalidArgumentError`` and reaches no plugin. The wrapper is meant for a cache that only kvplug
drives: it starts empty and every page it learns about comes from ``insert_prefix``.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import numpy as np
import torch

from kvplug.interface import (
    BaseCacheHandle,
    BasePrefixCache,
    InsertResult,
    InvalidArgumentError,
    MatchResult,
    PrefixCacheFault,
    SizeInfo,
)
from kvplug.prefix_cache.validation import (
    check_insert_shapes, check_token_ids, checked_evict_request, reject_unlock_flag,
)


class CheckedHandle(BaseCacheHandle):
    """A handle of the wrapped cache with its checked locations (kvplug reads these, never the
    plugin's tensor again, so a plugin that later changes its tensor changes nothing here).

    Attributes:
        inner: the plugin's handle (what the plugin's ``lock_handle`` is given).
        cached_len: checked, page-aligned.
        pages: shape ``[cached_len / page_size]``, int64, host; the handle's page numbers.
        locks: locks taken through this handle and not released.
    """

    def __init__(self, owner: "CheckedPrefixCache", inner: Any, cached_len: int, indices: torch.Tensor,
                 pages: np.ndarray) -> None:
        self.owner = owner
        self.inner = inner
        self.cached_len = cached_len
        self._indices = indices
        self.pages = pages
        self.locks = 0

    def get_matched_indices(self) -> torch.Tensor:
        """shape ``[cached_len]``, int32, the cache's device (a checked copy)."""
        return self._indices


class CheckedPrefixCache(BasePrefixCache):
    """``inner`` with every answer checked (see the module docstring).

    Args:
        inner: the untrusted ``BasePrefixCache``, empty.
        num_pages: pages of the KV pool it indexes (dummy page excluded).
        page_size: tokens per page (the pool's).
        name: how messages name the plugin (its registered name); default: its class.

    Raises ``PrefixCacheFault`` when ``inner`` already holds tokens or its ``size_info`` fails.
    """

    trusted = True  # the wrapper is kvplug's own: never wrapped again

    def __init__(self, inner: BasePrefixCache, *, num_pages: int, page_size: int, name: str | None = None) -> None:
        if isinstance(inner, CheckedPrefixCache):
            raise InvalidArgumentError(f"{inner!r} is already checked")
        for label, value in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{label} must be a positive int, got {value!r}")
        self.inner = inner
        self.name = name or type(inner).__name__
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = getattr(inner, "device", torch.device("cpu"))
        self._pool_end = num_pages * page_size
        self._offsets = np.arange(page_size, dtype=np.int32)
        self._held = np.zeros(num_pages, dtype=bool)  # pages the cache holds
        self._locks = np.zeros(num_pages, dtype=np.int64)  # locks through handles, per page
        self._scratch = np.zeros(num_pages, dtype=np.int64)  # duplicate detection, never reset
        self._order = np.arange(num_pages, dtype=np.int64)
        self._held_pages = 0
        self._locked_pages = 0
        self._listeners: list = []
        size = self._call("size_info", lambda: inner.size_info)
        evictable, protected = self._size_values(size)
        if evictable or protected:
            raise self._fault("size_info", f"holds {evictable + protected} tokens before kvplug gave it any (it must "
                                           "start empty: the pool it indexes is new)")

    def __repr__(self) -> str:
        return f"CheckedPrefixCache({self.name!r}, {self._held_pages} pages held)"

    # ------------------------------------------------------------------ plugin calls
    def _fault(self, method: str, what: str) -> PrefixCacheFault:
        return PrefixCacheFault(f"prefix cache {self.name!r}: {method} {what}", plugin=self.name, method=method)

    def _call(self, method: str, call: Callable[[], Any]) -> Any:
        """``call()``; any exception from the plugin (``SystemExit`` too) becomes a fault."""
        try:
            return call()
        except (Exception, SystemExit) as error:
            raise self._fault(method, f"raised {type(error).__name__}: {error}") from error

    def _locations(self, method: str, value: Any, what: str) -> np.ndarray:
        """A returned location tensor as a host array: shape ``[n]``, int64."""
        if not isinstance(value, torch.Tensor):
            raise self._fault(method, f"returned {what} of type {type(value).__name__}, expected a torch.Tensor")
        if value.dtype is not torch.int32 or value.dim() != 1:
            raise self._fault(method, f"returned {what} of dtype {value.dtype} and shape {tuple(value.shape)}, "
                                      "expected a 1-D int32 tensor")
        if value.device.type != "cpu" or value.requires_grad:
            value = value.detach().cpu()
        return value.numpy()  # a view: read here, copied (``_as_tensor``) before it is handed on

    def _pages(self, method: str, locations: np.ndarray, what: str, *, whole: bool = True) -> np.ndarray:
        """Page numbers of ``locations`` (shape ``[n]``, int32, host), checked: inside the pool,
        whole pages (``whole=False``: only that each page's first location starts a page), distinct.
        O(n): one pass over the locations, the rest over their pages."""
        size, n = self.page_size, locations.size
        if n == 0:
            return np.empty(0, dtype=np.int64)
        if n % size:
            raise self._fault(method, f"returned {n} locations as {what}: not whole pages of {size}")
        by_page = locations.reshape(-1, size)
        if whole and size > 1 and not ((by_page - by_page[:, :1]) == self._offsets).all():
            raise self._fault(method, f"returned {what} that are not whole pages (each page's locations must be "
                                      f"start .. start + {size - 1}, start a multiple of {size})")
        starts = by_page[:, 0].astype(np.int64)
        low, high = int(starts.min()), int(starts.max()) + size - 1  # whole pages: the starts bound them
        if low < 0 or high >= self._pool_end:
            bad = low if low < 0 else high
            raise self._fault(method, f"returned location {bad} in {what}, outside the pool [0, {self._pool_end}) "
                                      f"({self.num_pages} pages of {size})")
        pages, misaligned = np.divmod(starts, size) if size > 1 else (starts, None)
        if misaligned is not None and misaligned.any():
            raise self._fault(method, f"returned {what} that are not whole pages (each page's locations must be "
                                      f"start .. start + {size - 1}, start a multiple of {size})")
        if pages.size > 1:
            order = self._order[: pages.size]
            scratch = self._scratch
            scratch[pages] = order  # a page listed twice keeps only its last position
            if not (scratch[pages] == order).all():
                twice = int(pages[np.flatnonzero(scratch[pages] != order)[0]])
                raise self._fault(method, f"returned page {twice} (location {twice * size}) twice in {what}")
        return pages

    def _as_tensor(self, locations: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(locations.astype(np.int32))  # a copy: the plugin's tensor may change later
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def _length(self, method: str, value: Any, limit: int, what: str) -> int:
        try:
            if isinstance(value, bool):
                raise TypeError
            length = operator.index(value)
        except TypeError:
            raise self._fault(method, f"returned {what} {value!r}, expected an int") from None
        if not 0 <= length <= limit or length % self.page_size:
            raise self._fault(method, f"returned {what} {length}, expected a multiple of {self.page_size} in "
                                      f"[0, {limit}]")
        return length

    def _handle(self, method: str, result: Any, result_type: type) -> Any:
        if not isinstance(result, result_type):
            raise self._fault(method, f"returned {type(result).__name__}, expected {result_type.__name__}")
        return result.handle

    def _check_held(self, method: str, pages: np.ndarray, what: str) -> None:
        if pages.size and not self._held[pages].all():
            page = int(pages[np.flatnonzero(~self._held[pages])[0]])
            raise self._fault(method, f"returned location {page * self.page_size} in {what}, which it does not hold "
                                      "(never inserted, or evicted)")

    def _check_size(self, method: str) -> None:
        """After a change: ``size_info`` must total what the cache holds."""
        size = self._call("size_info", lambda: self.inner.size_info)
        self._checked_size(size, f"size_info after {method}")

    # ------------------------------------------------------------------ BasePrefixCache
    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        check_token_ids(input_ids, self.device)
        handle = self._handle("match_prefix", self._call("match_prefix", lambda: self.inner.match_prefix(input_ids)),
                              MatchResult)
        cached_len = self._length("match_prefix", getattr(handle, "cached_len", None), int(input_ids.shape[0]),
                                  "cached_len")
        return MatchResult(self._checked_handle("match_prefix", handle, cached_len, "the match"))

    def _checked_handle(self, method: str, handle: Any, cached_len: int, what: str) -> CheckedHandle:
        indices = self._call(method, handle.get_matched_indices)
        locations = self._locations(method, indices, f"matched indices of {what}")
        if locations.size != cached_len:
            raise self._fault(method, f"returned a handle with cached_len {cached_len} but {locations.size} matched "
                                      "indices")
        pages = self._pages(method, locations, f"{what}'s locations")
        self._check_held(method, pages, f"{what}'s locations")
        return CheckedHandle(self, handle, cached_len, self._as_tensor(locations), pages)

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        if unlock.__class__ is not bool:
            reject_unlock_flag(unlock)
        if not isinstance(handle, CheckedHandle) or handle.owner is not self:
            raise InvalidArgumentError(f"expected a handle from this checked {self.name!r} cache, got {handle!r}")
        pages, locks = handle.pages, self._locks
        if unlock and pages.size and not locks[pages].all():
            raise InvalidArgumentError(f"unlocking a handle of {handle.cached_len} tokens that holds no lock")
        if not unlock and pages.size and not self._held[pages].all():
            raise self._fault("lock_handle", "was asked to lock a handle whose pages it evicted since the match")
        self._call("lock_handle", lambda: self.inner.lock_handle(handle.inner, unlock))
        if unlock:
            locks[pages] -= 1
            self._locked_pages -= int(np.count_nonzero(locks[pages] == 0))
            handle.locks -= 1
        else:
            self._locked_pages += int(np.count_nonzero(locks[pages] == 0))
            locks[pages] += 1
            handle.locks += 1

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        check_insert_shapes(input_ids, indices, self.device, self.page_size)
        given = indices.detach().cpu().numpy()
        try:
            # kvplug's own locations (the allocator hands out whole pages): their page starts are checked
            given_pages = self._pages("insert_prefix", given, "indices", whole=False)
        except PrefixCacheFault as error:  # the caller's locations, not the plugin's answer
            raise InvalidArgumentError(f"insert_prefix indices: {error}") from None
        n = given.size
        result = self._call("insert_prefix", lambda: self.inner.insert_prefix(input_ids, indices))
        if not isinstance(result, InsertResult):
            raise self._fault("insert_prefix", f"returned {type(result).__name__}, expected InsertResult")
        cached_len = self._length("insert_prefix", result.cached_len, n, "cached_len")
        handle = result.handle
        handle_len = self._length("insert_prefix", getattr(handle, "cached_len", None), n, "a handle with cached_len")
        if handle_len != n:
            raise self._fault("insert_prefix", f"returned a handle of {handle_len} tokens for an insert of {n}")
        located = self._locations("insert_prefix", self._call("insert_prefix", handle.get_matched_indices),
                                  "the handle's matched indices")
        if located.size != n or not np.array_equal(located[cached_len:], given[cached_len:]):
            raise self._fault("insert_prefix", f"reports {cached_len} of {n} tokens cached before, but its handle "
                                               "does not keep the given locations after them")
        # past cached_len the handle holds the given (checked) locations; before it, pages it held already
        first_new = cached_len // self.page_size
        cached_pages = self._pages("insert_prefix", located[:cached_len], "the cached part of its handle")
        self._check_held("insert_prefix", cached_pages, "the cached part of its handle")
        pages = np.concatenate([cached_pages, given_pages[first_new:]])
        new_pages = given_pages[first_new:]
        if new_pages.size and self._held[new_pages].any():
            page = int(new_pages[np.flatnonzero(self._held[new_pages])[0]])
            raise self._fault("insert_prefix", f"reports cached_len {cached_len} of {n}, so it took location "
                                               f"{page * self.page_size} anew, but it already held it (it lost part "
                                               "of a prefix that was locked)")
        self._held[new_pages] = True
        self._held_pages += int(new_pages.size)
        self._check_size("insert_prefix")
        return InsertResult(cached_len, CheckedHandle(self, handle, n, self._as_tensor(located), pages))

    def evict(self, size: int) -> torch.Tensor:
        size = checked_evict_request(size)
        evicted = self._call("evict", lambda: self.inner.evict(size))
        locations = self._locations("evict", evicted, "the evicted locations")
        if locations.size < size:
            raise self._fault("evict", f"returned {locations.size} locations for evict({size}): fewer than asked")
        pages = self._pages("evict", locations, "the evicted locations")
        self._check_held("evict", pages, "the evicted locations")
        if pages.size and self._locks[pages].any():
            page = int(pages[np.flatnonzero(self._locks[pages])[0]])
            raise self._fault("evict", f"returned location {page * self.page_size}, which a locked handle (a live "
                                       "request) holds")
        self._held[pages] = False
        self._held_pages -= int(pages.size)
        try:
            self._check_size("evict")
        except PrefixCacheFault:  # nothing was handed back: the pages stay the cache's (``held_pages``)
            self._held[pages] = True
            self._held_pages += int(pages.size)
            raise
        return self._as_tensor(locations)

    def reset(self) -> None:
        self._call("reset", self.inner.reset)
        self._held[:] = False
        self._locks[:] = 0
        self._held_pages = self._locked_pages = 0
        self._check_size("reset")

    @property
    def size_info(self) -> SizeInfo:
        size = self._call("size_info", lambda: self.inner.size_info)
        return self._checked_size(size, "size_info")

    def _size_values(self, size: Any) -> tuple[int, int]:
        try:
            evictable, protected = operator.index(size.evictable_size), operator.index(size.protected_size)
        except (AttributeError, TypeError):
            raise self._fault("size_info", f"returned {size!r}, expected a SizeInfo of two ints") from None
        if evictable < 0 or protected < 0:
            raise self._fault("size_info", f"returned negative sizes {evictable}, {protected}")
        return evictable, protected

    def _checked_size(self, size: Any, method: str) -> SizeInfo:
        evictable, protected = self._size_values(size)
        size_p, held, locked = self.page_size, self._held_pages, self._locked_pages
        if evictable + protected != held * size_p:
            raise self._fault(method, f"reports {evictable + protected} tokens ({evictable} evictable + {protected} "
                                      f"protected), but it holds {held * size_p}")
        if evictable > (held - locked) * size_p:
            raise self._fault(method, f"reports {evictable} evictable tokens, but only {(held - locked) * size_p} of "
                                      f"the {held * size_p} it holds are unlocked")
        return SizeInfo(evictable, protected)

    @property
    def tracked_size_info(self) -> SizeInfo:
        """What the wrapper knows the cache holds, from its own bookkeeping (no plugin call)."""
        held, locked = self._held_pages * self.page_size, self._locked_pages * self.page_size
        return SizeInfo(held - locked, locked)

    def held_pages(self) -> tuple[np.ndarray, np.ndarray]:
        """The pages the cache holds (shape ``[n]``, int64, host, ascending) and each one's lock
        count (same shape): what a host that quarantines the cache hands over, asking it nothing."""
        pages = np.flatnonzero(self._held)
        return pages, self._locks[pages].copy()

    def check_integrity(self) -> None:
        self.inner.check_integrity()
        assert int(self._held.sum()) == self._held_pages, "checked cache: held page count drifted"
        assert int(np.count_nonzero(self._locks)) == self._locked_pages, "checked cache: locked page count drifted"
        assert not (self._locks < 0).any(), "checked cache: a negative lock count"
        assert not (self._locks.astype(bool) & ~self._held).any(), "checked cache: a locked page it does not hold"
        self.size_info  # noqa: B018 (raises PrefixCacheFault on a wrong total)

    # ------------------------------------------------------------------ KV events: the plugin's own
    @property
    def publishes_kv_events(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.inner, "publishes_kv_events", False))

    def add_kv_event_listener(self, listener) -> bool:
        added = bool(self._call("add_kv_event_listener", lambda: self.inner.add_kv_event_listener(listener)))
        if added:
            self._listeners.append(listener)
        return added

    def remove_kv_event_listener(self, listener) -> None:
        self._call("remove_kv_event_listener", lambda: self.inner.remove_kv_event_listener(listener))
        if listener in self._listeners:
            self._listeners.remove(listener)

    @property
    def kv_event_listeners(self) -> tuple:
        """Listeners registered through the wrapper (moved to a replacement cache)."""
        return tuple(self._listeners)

    @property
    def has_kv_event_listeners(self) -> bool:
        return bool(self._listeners)
