"""A decode step's device-side batch fields in one Triton launch (``DecodeStager``'s kernel).

The host writes each request's table row, cached and device length (and the step's number) into
a pinned host buffer (``decode_slot``); this kernel reads it in place - pinned memory is
device-accessible, so no upload call - and writes the batch fields the attention kernels read to
the slot's device buffer, with what derives from them: the flat cell of the new token
(``row * row_width + cached``, int32), the cell after it (int64, where the step's commit puts
the sampled id), ``out_loc`` (the new token's pool location, read from the page table) and the
input ids (the token pool at the new token's cell). Field offsets come from
``kvplug.attention.decode_staging`` (``SlotOffsets``). Program 0 writes the step's number back to
pinned memory (``StepProgress``): every read of earlier steps' host buffers precedes this launch
on the stream. Bound through ``FastLauncher.bind``, a step costs one launch of host time.

With new pages (``PagedAllocator.take_decode_pages``) the host also writes, per request, the
first location of its new page (or -1): the kernel first writes that page into
the table, token by token from the request's cached length (a decode step's new page starts
there), clipped to the row, and takes ``out_loc`` from it - the allocator's table write, without
its upload and scatter.

With pending tokens (``DecodeStep.commit`` of the previous step over the same requests), the
committed ids, one per live request, go into the token pool at each request's token cell - the
commit's scatter, without its own launch. Either way the kernel writes the input ids (the token
pool at the token cell) to the slot: ``input_ids`` without a gather.

With page lists (the attention backend's FlashInfer-style CSR ``indices``), the host writes their
``indptr`` too (it computes it for ``plan()`` anyway) and programs after the batch fields' copy
each request's every ``S``-th table entry, over ``S`` - the ``PageListWriter`` launch folded
into this one. A page this launch writes is taken from the free list, not read back.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from kvplug.attention.triton_kernels.page_lists import BLOCK_PAGES, TARGET_PROGRAMS, copy_page_list
from kvplug.attention.decode_staging import SlotOffsets
from kvplug.kernels.launch import FastLauncher


@triton.jit
def _batch_fields(
    slot_ptr, host_ptr, append_ptr, table_ptr, tokens_ptr, values_ptr, progress_ptr, batch_size, row_width,
    num_values, h_rows, h_cached, h_device, h_page_slot, d_rows, d_cached, d_device, d_token_index, d_out_loc,
    d_input_ids, program, PAGE_SIZE: tl.constexpr, PAGE_P2: tl.constexpr, HAS_PAGES: tl.constexpr,
    HAS_APPENDS: tl.constexpr, BLOCK: tl.constexpr,
):
    request = program * BLOCK + tl.arange(0, BLOCK)
    mask = request < batch_size
    # the host buffer is pinned memory, read in place: copy the batch fields to the device
    rows = tl.load(host_ptr + h_rows + request, mask=mask, other=0)
    cached = tl.load(host_ptr + h_cached + request, mask=mask, other=0)
    device = tl.load(host_ptr + h_device + request, mask=mask, other=0)
    tl.store(slot_ptr + d_rows + request, rows, mask=mask)
    tl.store(slot_ptr + d_cached + request, cached, mask=mask)
    tl.store(slot_ptr + d_device + request, device, mask=mask)
    cell = rows.to(tl.int64) * row_width + cached
    location = tl.load(table_ptr + cell, mask=mask, other=0)
    if HAS_PAGES:
        page = tl.load(host_ptr + h_page_slot + request, mask=mask, other=-1)
        growing = mask & (page >= 0)
        offsets = tl.arange(0, PAGE_P2)
        write = growing[:, None] & (offsets[None, :] < PAGE_SIZE) & (cached[:, None] + offsets[None, :] < row_width)
        tl.store(table_ptr + cell[:, None] + offsets[None, :], page[:, None] + offsets[None, :], mask=write)
        location = tl.where(growing, page, location)
    tl.store(slot_ptr + d_token_index + request, cell.to(tl.int32), mask=mask)
    tl.store(slot_ptr + d_out_loc + request, location, mask=mask)
    tl.store(append_ptr + request, cell + 1, mask=mask)
    token = tl.load(tokens_ptr + cell, mask=mask, other=0)
    if HAS_APPENDS:
        # the previous step's committed id of this (live) request belongs at this step's token
        # cell; padding requests past num_values keep what the pool holds
        pending = mask & (request < num_values)
        token = tl.where(pending, tl.load(values_ptr + request, mask=pending, other=0), token)
        tl.store(tokens_ptr + cell, token, mask=pending)
    tl.store(slot_ptr + d_input_ids + request, token, mask=mask)
    if program == 0:
        # the host may reuse the host buffers of every step before this one once it sees this
        # number: all their readers (copies, plan()'s) precede this launch on the stream
        tl.store(progress_ptr, tl.load(host_ptr))


@triton.jit
def _page_list(
    host_ptr, table_ptr, indices_ptr, batch_size, row_width, list_splits, job, h_rows, h_cached,
    h_page_slot, h_indptr, HAS_PAGES: tl.constexpr, LIST_PAGE_SIZE: tl.constexpr, LIST_BLOCK: tl.constexpr,
):
    # job = request * list_splits + split: the split's strided blocks of the request's pages
    request = job // list_splits
    split = job % list_splits
    row = tl.load(host_ptr + h_rows + request)
    cached = tl.load(host_ptr + h_cached + request)
    start = tl.load(host_ptr + h_indptr + request)
    own_pages = cached // LIST_PAGE_SIZE + 1  # the new token at `cached` is in the last one
    row_base = table_ptr + row.to(tl.int64) * row_width
    fresh_page = -1
    new_location = 0
    if HAS_PAGES:
        # a page this launch writes: the other programs' table store is not ordered before
        # this load, so it comes from the host buffer (it starts the request's last view page)
        page = tl.load(host_ptr + h_page_slot + request)
        new_location = tl.where(page >= 0, page, 0)
        fresh_page = tl.where(page >= 0, cached // LIST_PAGE_SIZE, -1)
    copy_page_list(
        row_base, indices_ptr, start, own_pages, split, list_splits, fresh_page, new_location, LIST_PAGE_SIZE,
        LIST_BLOCK,
    )


@triton.jit(do_not_specialize=[
    "batch_size", "row_width", "list_splits", "num_values", "h_rows", "h_cached", "h_device", "h_page_slot",
    "h_indptr", "d_rows", "d_cached", "d_device", "d_token_index", "d_out_loc", "d_input_ids",
])
def _decode_step_kernel(
    slot_ptr,
    host_ptr,
    append_ptr,
    table_ptr,
    tokens_ptr,
    values_ptr,
    num_values,
    indices_ptr,
    progress_ptr,
    batch_size,
    row_width,
    list_splits,
    h_rows,
    h_cached,
    h_device,
    h_page_slot,
    h_indptr,
    d_rows,
    d_cached,
    d_device,
    d_token_index,
    d_out_loc,
    d_input_ids,
    PAGE_SIZE: tl.constexpr,
    PAGE_P2: tl.constexpr,
    HAS_PAGES: tl.constexpr,
    HAS_APPENDS: tl.constexpr,
    LIST_PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    LIST_BLOCK: tl.constexpr,
):
    # offsets: kvplug.attention.decode_staging's slot layout (SlotOffsets). The first programs fill the
    # batch fields, BLOCK requests each; with page lists (LIST_PAGE_SIZE > 0) list_splits
    # programs per request follow
    program = tl.program_id(0)
    field_programs = tl.cdiv(batch_size, BLOCK)
    if program < field_programs:
        _batch_fields(
            slot_ptr, host_ptr, append_ptr, table_ptr, tokens_ptr, values_ptr, progress_ptr, batch_size,
            row_width, num_values, h_rows, h_cached, h_device, h_page_slot, d_rows, d_cached, d_device,
            d_token_index, d_out_loc, d_input_ids, program, PAGE_SIZE, PAGE_P2, HAS_PAGES, HAS_APPENDS, BLOCK,
        )
    elif LIST_PAGE_SIZE > 0:
        _page_list(
            host_ptr, table_ptr, indices_ptr, batch_size, row_width, list_splits,
            program - field_programs, h_rows, h_cached, h_page_slot, h_indptr, HAS_PAGES, LIST_PAGE_SIZE, LIST_BLOCK,
        )


_launch_decode_step = FastLauncher(_decode_step_kernel)


def bind_decode_step(
    slot: torch.Tensor,
    host: torch.Tensor,
    append_index: torch.Tensor,
    offsets: SlotOffsets,
    page_table: torch.Tensor,
    token_pool: torch.Tensor,
    batch_size: int,
    page_size: int,
    progress: torch.Tensor,
    *,
    with_pages: bool = False,
    with_tokens: torch.Tensor | None = None,
    page_lists: tuple[torch.Tensor, int] | None = None,
) -> Callable[..., None]:
    """The launch that fills a staged slot's token index, out_loc, append index and input ids
    (and page lists), bound once per slot, batch size and page-list buffer (each call then costs
    the launch).

    Called with the per-step values: the previous step's committed token ids and their count
    (``with_tokens``: written into the token pool at the first ``count`` requests' token cells,
    and they are those requests' input ids). ``with_pages``: the host buffer's ``page_slot``
    field holds new pages' first locations, written into the table first.

    Args:
        slot: shape ``[device_size(batch_size)]``, int32, cuda; the slot's device buffer
            (``decode_slot`` layout).
        host: shape ``[host_size(batch_size)]``, int32, pinned host memory (device-accessible);
            the slot's host buffer for this batch size, written before each call, read in place.
        append_index: shape ``[batch_size]``, int64, cuda; the slot's ``append_index`` field.
        offsets: ``SlotOffsets.for_batch(batch_size)``: where each field starts in both buffers.
        page_table: shape ``[rows, row_width]``, int32, contiguous, cuda.
        token_pool: same shape, int32, contiguous, cuda.
        page_size: tokens per page.
        progress: shape ``[1]``, int32, pinned host memory (device-accessible); each launch
            writes the uploaded step number there.
        with_tokens: shape ``[<= batch_size]``, int32, cuda, contiguous; an example of the ids.
        page_lists: ``(indices, S)``: also write each request's CSR page list for a view of
            ``S`` tokens a page into ``indices`` (int32, cuda, large enough for every step this
            launch serves) from the uploaded ``indptr``.
    """
    page_p2 = max(2, 1 << (page_size - 1).bit_length())
    block = _block(page_p2)
    field_programs = triton.cdiv(batch_size, block)
    indices, list_page_size = page_lists if page_lists is not None else (slot, 0)
    # a request's pages split over enough programs to fill the GPU when one request is long;
    # programs past a request's last block exit at once, so one grid serves every step
    list_splits = triton.cdiv(TARGET_PROGRAMS, batch_size) if page_lists is not None else 1
    grid = (field_programs + (batch_size * list_splits if page_lists is not None else 0),)
    # a pointer the launch does not read is given the slot
    args = (
        slot, host, append_index, page_table, token_pool,
        slot if with_tokens is None else with_tokens, batch_size if with_tokens is None else with_tokens.shape[0],
        indices, progress, batch_size, page_table.shape[1], list_splits,
        offsets.host_rows, offsets.host_cached, offsets.host_device, offsets.host_page_slot, offsets.host_indptr,
        offsets.rows, offsets.cached, offsets.device, offsets.token_index, offsets.out_loc, offsets.input_ids,
    )
    constexprs = dict(
        PAGE_SIZE=page_size, PAGE_P2=page_p2, HAS_PAGES=bool(with_pages),
        HAS_APPENDS=with_tokens is not None, LIST_PAGE_SIZE=list_page_size, BLOCK=block, LIST_BLOCK=BLOCK_PAGES,
    )
    if with_tokens is None:
        return _launch_decode_step.bind(grid, *args, **constexprs)
    return _launch_decode_step.bind_all_but([5, 6], grid, *args, **constexprs)


def _block(page_p2: int) -> int:
    """Requests per program: 256, fewer for big pages (a program writes BLOCK x PAGE_P2 cells)."""
    return max(16, min(256, 4096 // page_p2))
