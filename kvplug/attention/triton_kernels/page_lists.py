"""FlashInfer's page lists from the token-granular page table, in one Triton launch.

FlashInfer takes a batch's pages as one CSR array: request ``i``'s ``pages_i = ceil(len_i / S)``
page numbers start at ``indptr[i]``. Built from torch ops this is an upload, a
``repeat_interleave``, a gather and a divide: four to six calls whose host cost (10-55 us each
on the H200 hosts) dominated the step. Here one launch does it: each program recomputes its
request's start as the sum of the earlier requests' page counts (``bs`` loads, far cheaper than a
second launch for a prefix sum), then copies every ``S``-th table entry of its row, divided by
``S``. Programs of a request split its pages in strided blocks, so one long request still fills
the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplug.kernels.launch import FastLauncher

BLOCK_PAGES = 1024
TARGET_PROGRAMS = 512  # enough to cover the SMs a few times over for a lone long request


@triton.jit(do_not_specialize=["batch_size", "row_width"])
def _page_lists_kernel(
    table_ptr,
    rows_ptr,
    lens_ptr,
    indices_ptr,
    batch_size,
    row_width,
    VIEW_PAGE_SIZE: tl.constexpr,
    BATCH_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    request = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    requests = tl.arange(0, BATCH_P2)
    lens = tl.load(lens_ptr + requests, mask=requests < batch_size, other=0)
    pages = (lens + VIEW_PAGE_SIZE - 1) // VIEW_PAGE_SIZE
    start = tl.sum(tl.where(requests < request, pages, 0), axis=0)
    own_pages = (tl.load(lens_ptr + request) + VIEW_PAGE_SIZE - 1) // VIEW_PAGE_SIZE
    row_base = table_ptr + tl.load(rows_ptr + request).to(tl.int64) * row_width
    for first in range(split * BLOCK, own_pages, num_splits * BLOCK):
        page = first + tl.arange(0, BLOCK)
        mask = page < own_pages
        location = tl.load(row_base + page.to(tl.int64) * VIEW_PAGE_SIZE, mask=mask)
        if VIEW_PAGE_SIZE > 1:
            location = location // VIEW_PAGE_SIZE  # locations are >= 0: floor division
        tl.store(indices_ptr + start + page, location, mask=mask)


_launch_page_lists = FastLauncher(_page_lists_kernel)


def build_page_lists(
    page_table: torch.Tensor,
    table_rows: torch.Tensor,
    device_lens: torch.Tensor,
    view_page_size: int,
    total_pages: int,
) -> torch.Tensor:
    """The CSR page numbers of a batch: shape ``[total_pages]``, int32, cuda; request ``i``'s
    entries are ``page_table[table_rows[i], j * S] // S`` for ``j < ceil(device_lens[i] / S)``.

    Args:
        page_table: shape ``[rows, row_width]``, int32, contiguous, cuda.
        table_rows: shape ``[bs]``, int32, cuda; rows in range (not checked: kvplug built them).
        device_lens: shape ``[bs]``, int32, cuda; each in ``[1, row_width]``.
        view_page_size: ``S``, tokens per page of the view (1: token view).
        total_pages: ``sum(ceil(device_lens / S))``, known on the host.
    """
    indices = torch.empty(total_pages, dtype=torch.int32, device=page_table.device)
    batch_size = table_rows.shape[0]
    if batch_size == 0 or total_pages == 0:
        return indices
    # programs past a request's last block exit at once: a grid from the batch size alone
    # saves the host a max() over the lengths
    num_splits = -(-TARGET_PROGRAMS // batch_size)
    _launch_page_lists(
        (batch_size, num_splits),
        page_table,
        table_rows,
        device_lens,
        indices,
        batch_size,
        page_table.shape[1],
        VIEW_PAGE_SIZE=view_page_size,
        BATCH_P2=max(16, 1 << (batch_size - 1).bit_length()),
        BLOCK=BLOCK_PAGES,
    )
    return indices
