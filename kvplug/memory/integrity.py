"""Whole-state checks of the paged allocator (tests and debug runs; reads every live row).

Invariants (docs/design.md, section 1):

- the free list holds page starts (multiples of the page size) inside the pool, never the
  dummy page, each at most once;
- each live request's row is whole pages: column ``j`` holds ``page_start + j % page_size``;
  its first ``prefix_len`` columns are its locked cache handle's locations;
- conservation: ``free + cached (evictable + protected) + owned by live requests == num_pages``;
- no page is both free and owned, or owned by two requests, and no locked prefix page is free
  or owned by a request;
- the dummy row still points at the dummy page.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvplug.memory.allocator import PagedAllocator


def check_allocator(allocator: "PagedAllocator", free_page_starts: torch.Tensor) -> None:
    """Raise ``AssertionError`` naming the first broken invariant.

    Args:
        free_page_starts: shape ``[f]``, int32, host (numpy); the free list plus pending lazy frees.
    """
    size, num_pages = allocator.page_size, allocator.num_pages
    pool_end = num_pages * size
    free = torch.from_numpy(free_page_starts).long()
    _check_page_starts(free, size, pool_end, "free list")

    owned, protected = [], []
    table = allocator.page_table
    for request in allocator.live_requests:
        prefix = request.prefix_len
        assert prefix <= request.cached_len <= request.device_len <= request.allocated_len, (
            f"row {request.row}: expected prefix_len <= cached_len <= device_len <= allocated_len, got "
            f"{prefix}, {request.cached_len}, {request.device_len}, {request.allocated_len}"
        )
        assert request.allocated_len % size == 0 and prefix % size == 0, f"row {request.row}: lengths not page-aligned"
        recorded = min(request.allocated_len, table.row_width)
        row = torch.from_numpy(table.host_table[request.row, :recorded]).long()
        columns = torch.arange(recorded)
        expected = row[columns // size * size] + columns % size
        assert torch.equal(row, expected), f"row {request.row}: locations are not whole pages"
        if prefix:
            matched = request.handle.get_matched_indices().cpu().long()
            assert torch.equal(row[:prefix], matched), f"row {request.row}: prefix differs from its cache handle"
        starts = row[::size]
        _check_page_starts(starts, size, pool_end, f"row {request.row}")
        protected.append(starts[: prefix // size])
        owned.append(starts[prefix // size :])

    owned_pages = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
    held = torch.cat([free, owned_pages])
    assert torch.unique(held).numel() == held.numel(), "a page is owned twice (free list and/or live requests)"
    locked = torch.unique(torch.cat(protected)) if protected else torch.empty(0, dtype=torch.int64)
    assert not torch.isin(locked, held).any(), "a locked cache page is also free or owned by a request"

    cache_size = allocator.prefix_cache.size_info
    assert cache_size.total_size % size == 0, f"cache holds {cache_size.total_size} tokens, not whole pages"
    assert locked.numel() * size <= cache_size.protected_size, (
        f"live requests lock {locked.numel() * size} tokens, the cache protects only {cache_size.protected_size}"
    )
    cached_pages = cache_size.total_size // size
    assert free.numel() + cached_pages + owned_pages.numel() == num_pages, (
        f"conservation broken: {free.numel()} free + {cached_pages} cached + {owned_pages.numel()} owned "
        f"!= {num_pages} pages"
    )
    dummy = torch.from_numpy(table.host_table[table.dummy_row])
    assert bool((dummy == table.dummy_location).all()), "the dummy row no longer points at the dummy page"
    if not table.mirrored or table.has_staged_writes:
        return
    # the device tables agree with the host ones where kvplug wrote locations (a device read: tests only)
    for request in allocator.live_requests:
        recorded = min(request.allocated_len, table.row_width)
        on_device = table.table[request.row, :recorded].cpu().numpy()
        assert (on_device == table.host_table[request.row, :recorded]).all(), (
            f"row {request.row}: the device table differs from the host table"
        )


def _check_page_starts(starts: torch.Tensor, size: int, pool_end: int, where: str) -> None:
    if starts.numel() == 0:
        return
    assert bool((starts % size == 0).all()), f"{where}: a page start is not a multiple of page_size={size}"
    low, high = int(starts.min()), int(starts.max())
    assert low >= 0 and high < pool_end, (
        f"{where}: page starts must lie in [0, {pool_end}) (the dummy page starts at {pool_end}), got [{low}, {high}]"
    )
