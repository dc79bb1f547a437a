"""One ring slot of ``DecodeStager``: where a staged decode batch's fields live on the device,
and the torch ops equal to the decode-step kernel that fills the derived ones.

Layout of a slot for a batch of ``n``, in int32 units (one tensor, so one upload and one kernel
argument cover every field)::

    [0, 2n)            append index (int64; first, so it is 8-byte aligned)
    [2n, 3n)           table rows          -+
    [3n, 4n)           cached lengths       |  uploaded: the first 3n,
    [4n, 5n)           device lengths       |  4n with deferred pages,
    [5n, 6n)           page slot            |  6n + 1 with page lists
    [6n, 7n + 1)       page-list indptr     |
    [7n + 1, 8n + 1)   last-page lengths   -+
    [8n + 1, 9n + 1)   token index
    [9n + 1, 10n + 1)  out_loc

The kernel (``triton_kernels.decode_step``) reads these offsets; the GPU tests hold it to
``derive_with_torch``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def slot_size(batch_size: int) -> int:
    """int32 entries a slot needs for a batch of ``batch_size``."""
    return 10 * batch_size + 1


def upload_size(batch_size: int, with_pages: bool, with_page_lists: bool) -> int:
    """int32 entries the host copies in, from offset ``2n``."""
    if with_page_lists:
        return 6 * batch_size + 1
    return 4 * batch_size if with_pages else 3 * batch_size


class SlotViews(NamedTuple):
    """Views of one ring slot for one batch size ``n``: shape ``[n]``, int32, device, unless noted.

    Attributes:
        whole: shape ``[10n + 1]``; the slot (the kernel's argument).
        uploads: upload size -> the view the host buffer is copied into (see ``upload_size``).
        append_index: int64.
        launches: bound kernel launches, by whether the step has deferred pages.
    """

    whole: torch.Tensor
    uploads: dict
    append_index: torch.Tensor
    rows: torch.Tensor
    cached: torch.Tensor
    device: torch.Tensor
    page_slot: torch.Tensor
    token_index: torch.Tensor
    out_loc: torch.Tensor
    launches: dict


def make_slot_views(buffer: torch.Tensor, batch_size: int) -> SlotViews:
    """The views of ``buffer`` (int32, at least ``slot_size(batch_size)`` entries) for a batch."""
    n = batch_size
    whole = buffer[: slot_size(n)]
    append, rows, cached, device, page_slot, _lists, token_index, out_loc = whole.split_with_sizes(
        (2 * n, n, n, n, n, 2 * n + 1, n, n)
    )
    uploads = {size: whole[2 * n : 2 * n + size] for size in {3 * n, 4 * n, 6 * n + 1}}
    return SlotViews(
        whole, uploads, append.view(torch.int64), rows, cached, device, page_slot, token_index, out_loc, {}
    )


def derive_with_torch(
    views: SlotViews, flat_table: torch.Tensor, row_width: int, page_size: int, storage: torch.Tensor | None
) -> None:
    """What the decode-step kernel does for the batch fields, in torch ops (CPU tables used
    through torch, or no Triton): with ``storage`` (deferred pages), first each page slot's page
    into the table at its request's cached length, clipped to the row; then token index, out_loc
    and append index.

    Args:
        flat_table: shape ``[rows * row_width]``, int32, device; the page table, flat.
        storage: int32, device; the free list's tensor the page slots index.
    """
    if storage is not None:
        slots = views.page_slot
        growing = (slots >= 0).nonzero().squeeze(1)
        starts = views.rows[growing].long() * row_width + views.cached[growing]
        pages = storage[slots[growing].long()]
        offsets = torch.arange(page_size, device=flat_table.device)
        inside = (views.cached[growing, None] + offsets) < row_width
        cells = (starts[:, None] + offsets)[inside]
        flat_table[cells] = (pages[:, None] + offsets)[inside].to(torch.int32)
    torch.add(views.cached, views.rows, alpha=row_width, out=views.token_index)
    torch.index_select(flat_table, 0, views.token_index, out=views.out_loc)
    torch.add(views.token_index, 1, out=views.append_index)
