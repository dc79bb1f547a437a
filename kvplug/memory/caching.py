"""Giving pages back: a request's computed prefix into the prefix cache, the rest to the free list.

``PagedAllocator`` takes these methods from ``PrefixCaching``; they read its page size, page
table, prefix cache, free list and live-request map. A prefix the cache already holds (another
request inserted it meanwhile) leaves duplicate pages behind, which are freed here; frees may be
batched with ``lazy_free`` so a scheduling step concatenates the free list once.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable

import torch

from kvplug.interface import InvalidArgumentError
from kvplug.memory.request import Request

if TYPE_CHECKING:
    from kvplug.interface import BasePrefixCache
    from kvplug.memory.free_list import FreeList
    from kvplug.memory.page_table import PageTable


class PrefixCaching:
    """The releasing half of ``PagedAllocator`` (a mixin: the allocator sets these attributes)."""

    page_size: int
    page_table: PageTable
    prefix_cache: BasePrefixCache
    free_list: FreeList
    _live: dict[int, Request]
    flush_deferred_pages: Callable[[], None]

    def cache_request(self, request: Request, *, finished: bool) -> None:
        """Move ``request``'s computed page-aligned prefix into the prefix cache.

        The cache may already hold part of it (another request inserted it meanwhile): those
        duplicate pages are freed. Unfinished (between prefill chunks): the request keeps its
        tail pages, locks the new handle and its row is pointed at the cache's pages.
        Finished: every page the cache did not take goes back to the free list and the request
        stops being live (its row is the caller's to free).
        """
        self.check_live(request)
        self.flush_deferred_pages()  # the row is read below
        size, row = self.page_size, request.row
        aligned = request.cached_len // size * size
        old_handle = request.handle
        token_ids = self.page_table.read_tokens(row, 0, aligned)
        # the cache may keep the tensor it is given; the row itself will be overwritten later
        locations = self.page_table.locations(row, 0, aligned).clone()
        result = self.prefix_cache.insert_prefix(token_ids, locations)
        new_handle = result.handle
        self.prefix_cache.lock_handle(old_handle, unlock=True)
        old_len = int(old_handle.cached_len)
        duplicate_end = max(int(result.cached_len), old_len)
        self.free_list.release(locations[old_len:duplicate_end:size])
        if finished:
            kept_end = max(duplicate_end, int(new_handle.cached_len))
            self.free_list.release(self._owned_page_starts(request, kept_end))
            request.handle = None
            request.finished = True
            request._detach()
            del self._live[row]
            return
        self.prefix_cache.lock_handle(new_handle)
        if duplicate_end > old_len:
            cached = new_handle.get_matched_indices()[old_len:duplicate_end]
            self.page_table.write_locations(row, old_len, cached)
        request.handle = new_handle

    def check_live(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"expected a kvplug Request, got {type(request).__name__}")
        if request.finished or self._live.get(request.row) is not request:
            raise InvalidArgumentError(f"request in row {request.row} is not live (finished, or not from this allocator)")

    def lazy_free(self) -> contextlib.AbstractContextManager[None]:
        """Collect frees made inside the block and apply them at its end (one concatenation per
        scheduling step). Pages freed inside are not allocatable until the outermost block exits."""
        return self.free_list.lazy()

    def _owned_page_starts(self, request: Request, begin: int) -> torch.Tensor:
        """First locations of the pages ``request`` owns from token ``begin`` (page-aligned) on."""
        end = min(request.allocated_len, self.page_table.row_width)
        return self.page_table.table[request.row, begin:end:self.page_size]
