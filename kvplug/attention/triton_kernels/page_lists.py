"""FlashInfer's page lists from the token-granular page table, in one Triton launch.

FlashInfer takes a batch's pages as one CSR array: request ``i``'s ``pages_i = ceil(len_i / S)``
page numbers start at ``indptr[i]``. Built from torch ops this is an upload, a
``repeat_interleave``, a gather and a divide: four to six calls whose host cost dominated the
step. Here one launch does it: each program recomputes its
request's start as the sum of the earlier requests' page counts (``bs`` loads, far cheaper than a
second launch for a prefix sum), then copies every ``S``-th table entry of its row, divided by
``S``. Programs of a request split its pages in strided blocks, so one long request still fills
the GPU. ``PageListWriter`` owns the output buffers and binds the launch (``FastLauncher.bind``).
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from kvplug.kernels.launch import FastLauncher

BLOCK_PAGES = 1024
TARGET_PROGRAMS = 512  # enough to cover the SMs a few times over for a lone long request


@triton.jit
def copy_page_list(
    row_base, indices_ptr, start, own_pages, split, num_splits, fresh_page, fresh_location,
    VIEW_PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program's share of a request's page list: blocks ``split``, ``split + num_splits``, ...
    of its ``own_pages`` entries ``row_base[j * S] // S``, stored from ``indices_ptr + start``.
    Page ``fresh_page`` (-1: none) is ``fresh_location // S`` instead of the table's entry."""
    for first in range(split * BLOCK, own_pages, num_splits * BLOCK):
        page = first + tl.arange(0, BLOCK)
        mask = page < own_pages
        location = tl.load(row_base + page.to(tl.int64) * VIEW_PAGE_SIZE, mask=mask, other=0)
        location = tl.where(page == fresh_page, fresh_location, location)
        if VIEW_PAGE_SIZE > 1:
            location = location // VIEW_PAGE_SIZE  # locations are >= 0: floor division
        tl.store(indices_ptr + start + page, location, mask=mask)


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


class PageListWriter:
    """Writes a batch's page lists on the device: the CSR page numbers of request ``i`` are
    ``page_table[table_rows[i], j * S] // S`` for ``j < ceil(device_lens[i] / S)``.

    Output goes to a ring of persistent buffers (``ring_size``), so a result stays valid until
    ``ring_size`` writes later, like the decode batches it is built for. The launch is bound once
    per (rows, lengths, batch size, buffer) address set: a decode step's batch tensors are
    ``DecodeStager`` slot views, whose addresses repeat, so a step costs the launch alone.

    Args:
        page_table: shape ``[rows, row_width]``, int32, contiguous, cuda.
        view_page_size: ``S``, tokens per page of the view (1: token view).
    """

    MAX_BOUND = 256  # bound launches kept (callers with fresh tensors each step make new ones)

    def __init__(self, page_table: torch.Tensor, view_page_size: int, ring_size: int = 3) -> None:
        self.page_table = page_table
        self.view_page_size = int(view_page_size)
        self._buffers = [torch.empty(0, dtype=torch.int32, device=page_table.device) for _ in range(ring_size)]
        self._next = 0
        self._bound: dict[tuple, Callable[[], None]] = {}

    def write(self, table_rows: torch.Tensor, device_lens: torch.Tensor, total_pages: int) -> torch.Tensor:
        """Args:
            table_rows: shape ``[bs]``, int32, cuda; rows in range (not checked: kvplug built them).
            device_lens: shape ``[bs]``, int32, cuda; each in ``[1, row_width]``.
            total_pages: ``sum(ceil(device_lens / S))``, known on the host.

        Returns:
            shape ``[total_pages]``, int32, cuda; a view of a ring buffer.
        """
        slot = self._next
        self._next = slot + 1 if slot + 1 < len(self._buffers) else 0
        buffer = self._buffers[slot]
        if buffer.shape[0] < total_pages:
            buffer = self._buffers[slot] = torch.empty(
                1 << (total_pages - 1).bit_length(), dtype=torch.int32, device=self.page_table.device
            )
        batch_size = table_rows.shape[0]
        if batch_size and total_pages:
            key = (table_rows.data_ptr(), device_lens.data_ptr(), batch_size, buffer.data_ptr())
            launch = self._bound.get(key)
            if launch is None:
                if len(self._bound) >= self.MAX_BOUND:
                    self._bound.clear()
                launch = self._bound[key] = self._bind(table_rows, device_lens, buffer)
            launch()
        return buffer[:total_pages]

    def _bind(self, table_rows: torch.Tensor, device_lens: torch.Tensor, buffer: torch.Tensor) -> Callable[[], None]:
        batch_size = table_rows.shape[0]
        # programs past a request's last block exit at once: a grid from the batch size alone
        # lets one bound launch serve every step of that size
        num_splits = -(-TARGET_PROGRAMS // batch_size)
        return _launch_page_lists.bind(
            (batch_size, num_splits),
            self.page_table,
            table_rows,
            device_lens,
            buffer,
            batch_size,
            self.page_table.shape[1],
            VIEW_PAGE_SIZE=self.view_page_size,
            BATCH_P2=max(16, 1 << (batch_size - 1).bit_length()),
            BLOCK=BLOCK_PAGES,
        )
