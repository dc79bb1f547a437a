"""A decode step's device-side batch fields in one Triton launch (``DecodeStager``'s kernel).

The host uploads each request's table row and cached length (and its device length, which it
needs itself); this kernel derives the rest where they are used: the flat cell of the new token
(``row * row_width + cached``, int32, for ``input_ids``), the cell after it (int64, for
``append_tokens``' scatter) and ``out_loc``, the new token's pool location read from the page
table. Three torch ops (an add, a gather, an add) would cost ~40 us of host time on the H200
hosts; one launch bound through ``FastLauncher.bind`` costs ~9.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from kvplug.kernels.launch import FastLauncher

BLOCK_REQUESTS = 256


@triton.jit(do_not_specialize=["batch_size", "row_width"])
def _decode_step_kernel(
    slot_ptr,
    append_ptr,
    table_ptr,
    batch_size,
    row_width,
    BLOCK: tl.constexpr,
):
    # slot layout, int32 units for a batch of n: append index (int64, 2n) | rows | cached |
    # device | token index | out_loc (see kvplug.attention.decode_staging)
    request = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = request < batch_size
    rows = tl.load(slot_ptr + 2 * batch_size + request, mask=mask, other=0)
    cached = tl.load(slot_ptr + 3 * batch_size + request, mask=mask, other=0)
    cell = rows.to(tl.int64) * row_width + cached
    location = tl.load(table_ptr + cell, mask=mask, other=0)
    tl.store(slot_ptr + 5 * batch_size + request, cell.to(tl.int32), mask=mask)
    tl.store(slot_ptr + 6 * batch_size + request, location, mask=mask)
    tl.store(append_ptr + request, cell + 1, mask=mask)


_launch_decode_step = FastLauncher(_decode_step_kernel)


def bind_decode_fields(
    slot: torch.Tensor, append_index: torch.Tensor, page_table: torch.Tensor, batch_size: int
) -> Callable[[], None]:
    """The launch that fills a staged slot's token index, out_loc and append index from its rows
    and cached lengths, bound once per slot and batch size (each call then costs the launch).

    Args:
        slot: shape ``[7 * batch_size]``, int32, cuda; rows at ``[2n, 3n)`` and cached
            lengths at ``[3n, 4n)``, uploaded (in stream order) before each call.
        append_index: shape ``[batch_size]``, int64, cuda; ``slot[: 2n]`` viewed as int64.
        page_table: shape ``[rows, row_width]``, int32, contiguous, cuda.
    """
    return _launch_decode_step.bind(
        (triton.cdiv(batch_size, BLOCK_REQUESTS),),
        slot,
        append_index,
        page_table,
        batch_size,
        page_table.shape[1],
        BLOCK=BLOCK_REQUESTS,
    )
