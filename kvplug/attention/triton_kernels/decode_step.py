"""A decode step's device-side batch fields in one Triton launch (``DecodeStager``'s kernel).

The host uploads each request's table row and cached length (and its device length, which it
needs itself); this kernel derives the rest where they are used: the flat cell of the new token
(``row * row_width + cached``, int32, for ``input_ids``), the cell after it (int64, for
``append_tokens``' scatter) and ``out_loc``, the new token's pool location read from the page
table. Three torch ops (an add, a gather, an add) would cost ~40 us of host time on the H200
hosts; one launch bound through ``FastLauncher.bind`` costs ~9.

With deferred pages (``kvplug.memory.deferred_pages``) the host also uploads a page slot per
request (an index into the free list's tensor, or -1): the kernel first writes that page into
the table, token by token from the request's cached length (a decode step's new page starts
there), clipped to the row, and takes ``out_loc`` from it - the allocator's table write, without
its upload and scatter.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from kvplug.kernels.launch import FastLauncher


@triton.jit(do_not_specialize=["batch_size", "row_width"])
def _decode_step_kernel(
    slot_ptr,
    append_ptr,
    table_ptr,
    pages_ptr,
    batch_size,
    row_width,
    PAGE_SIZE: tl.constexpr,
    PAGE_P2: tl.constexpr,
    HAS_PAGES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # slot layout, int32 units for a batch of n: append index (int64, 2n) | rows | cached |
    # device | page slot | token index | out_loc (see kvplug.attention.decode_staging)
    request = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = request < batch_size
    rows = tl.load(slot_ptr + 2 * batch_size + request, mask=mask, other=0)
    cached = tl.load(slot_ptr + 3 * batch_size + request, mask=mask, other=0)
    cell = rows.to(tl.int64) * row_width + cached
    location = tl.load(table_ptr + cell, mask=mask, other=0)
    if HAS_PAGES:
        page_slot = tl.load(slot_ptr + 5 * batch_size + request, mask=mask, other=-1)
        growing = mask & (page_slot >= 0)
        page = tl.load(pages_ptr + page_slot, mask=growing, other=0)
        offsets = tl.arange(0, PAGE_P2)
        write = growing[:, None] & (offsets[None, :] < PAGE_SIZE) & (cached[:, None] + offsets[None, :] < row_width)
        tl.store(table_ptr + cell[:, None] + offsets[None, :], page[:, None] + offsets[None, :], mask=write)
        location = tl.where(growing, page, location)
    tl.store(slot_ptr + 6 * batch_size + request, cell.to(tl.int32), mask=mask)
    tl.store(slot_ptr + 7 * batch_size + request, location, mask=mask)
    tl.store(append_ptr + request, cell + 1, mask=mask)


_launch_decode_step = FastLauncher(_decode_step_kernel)


def bind_decode_fields(
    slot: torch.Tensor,
    append_index: torch.Tensor,
    page_table: torch.Tensor,
    batch_size: int,
    page_size: int,
    *,
    with_pages: torch.Tensor | None = None,
) -> Callable[..., None]:
    """The launch that fills a staged slot's token index, out_loc and append index, bound once
    per slot and batch size (each call then costs the launch).

    Without ``with_pages`` it is called with no argument. With it (an example free-list tensor,
    not kept) it is called with the step's pages tensor and writes the deferred pages first.

    Args:
        slot: shape ``[8 * batch_size]``, int32, cuda; rows at ``[2n, 3n)``, cached lengths at
            ``[3n, 4n)`` and (with pages) page slots at ``[5n, 6n)``, uploaded (in stream
            order) before each call.
        append_index: shape ``[batch_size]``, int64, cuda; ``slot[: 2n]`` viewed as int64.
        page_table: shape ``[rows, row_width]``, int32, contiguous, cuda.
        page_size: tokens per page.
        with_pages: int32, cuda; an example of the free-list tensor the page slots index.
    """
    page_p2 = max(2, 1 << (page_size - 1).bit_length())
    block = _block(page_p2)
    args = (slot, append_index, page_table, slot if with_pages is None else with_pages, batch_size, page_table.shape[1])
    grid = (triton.cdiv(batch_size, block),)
    constexprs = dict(PAGE_SIZE=page_size, PAGE_P2=page_p2, HAS_PAGES=with_pages is not None, BLOCK=block)
    if with_pages is None:  # the pages pointer is not read: the slot stands in
        return _launch_decode_step.bind(grid, *args, **constexprs)
    return _launch_decode_step.bind_all_but(3, grid, *args, **constexprs)


def _block(page_p2: int) -> int:
    """Requests per program: 256, fewer for big pages (a program writes BLOCK x PAGE_P2 cells)."""
    return max(16, min(256, 4096 // page_p2))
