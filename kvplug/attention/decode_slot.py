"""One ring slot of ``DecodeStager``: a persistent host buffer per batch size that a step writes,
the device buffer its fields end up in, and the views of both - made once, so a step slices
nothing.

Host buffer (pinned for a GPU table; one per slot and batch size, so fields written once stay:
``indptr[0] = 0``, the token view's last-page lengths of 1), int32 units for a batch of ``n``::

    [0]                step number (the kernel reports it back: see ``DecodeStager``)
    [1, n + 1)         table rows
    [n + 1, 2n + 1)    cached lengths
    [2n + 1, 3n + 1)   device lengths
    [3n + 1, 4n + 1)   page slot (deferred pages)
    [4n + 1, 5n + 2)   page-list indptr
    [5n + 2, 6n + 2)   last-page lengths

The decode-step kernel reads it in place (pinned memory is device-accessible) and writes rows,
cached and device lengths to the device buffer; without the kernel, a step copies the buffer's
first ``3n + 1`` entries (``4n + 1`` with deferred pages, ``6n + 2`` with page lists;
``upload_size``) to offset ``2n`` of the device buffer::

    [0, 2n)            append index (int64; first, so it is 8-byte aligned)
    [2n, 8n + 2)       the host buffer's entries, as above (the kernel writes rows, cached
                       and device lengths only)
    [8n + 2, 9n + 2)   token index
    [9n + 2, 10n + 2)  out_loc
    [10n + 2, 11n + 2) input ids (the token pool at the token index, after any deferred
                       append of the previous step is written there)

The kernel (``triton_kernels.decode_step``) reads these offsets; the GPU tests hold it to
``derive_with_torch``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


def device_size(batch_size: int) -> int:
    """int32 entries the device buffer needs for a batch of ``batch_size``."""
    return 11 * batch_size + 2


def host_size(batch_size: int) -> int:
    """int32 entries the host buffer needs for a batch of ``batch_size``."""
    return 6 * batch_size + 2


def upload_size(batch_size: int, with_pages: bool, with_page_lists: bool) -> int:
    """int32 entries a step copies from the host buffer to offset ``2n`` of the device buffer."""
    if with_page_lists:
        return 6 * batch_size + 2
    return 4 * batch_size + 1 if with_pages else 3 * batch_size + 1


class HostViews(NamedTuple):
    """The host buffer's fields for one batch size ``n``: numpy views the step writes (int32) and
    torch views of the same memory the batch carries (shape ``[n]`` unless noted).

    Attributes:
        whole: shape ``[6n + 2]``; the buffer (the kernel's argument).
        uploads: upload size -> the leading part of the buffer a step copies (without the kernel).
        step: shape ``[1]``; rows, cached, device, page_slot, page_ends (``indptr[1:]``), last:
            numpy.
        cached_lens, device_lens, indptr (``[n + 1]``), last_page_len: torch, cpu (pinned for a
            GPU table).
    """

    whole: torch.Tensor
    uploads: dict
    step: np.ndarray
    rows: np.ndarray
    cached: np.ndarray
    device: np.ndarray
    page_slot: np.ndarray
    page_ends: np.ndarray
    last_array: np.ndarray
    cached_lens: torch.Tensor
    device_lens: torch.Tensor
    indptr: torch.Tensor
    last_page_len: torch.Tensor


class SlotViews(NamedTuple):
    """The device buffer's fields for one batch size ``n``: shape ``[n]``, int32, table device,
    unless noted; ``host`` the host buffer's.

    Attributes:
        whole: shape ``[11n + 2]``; the kernel's argument.
        uploads: upload size -> the part of ``whole`` a step's host part is copied into.
        step: shape ``[1]``; the step number copied in.
        append_index: int64.
        input_ids: the token ids at the token index (``KVBackend.input_ids``).
        launches: bound kernel launches, by (deferred pages?, deferred appends?).
    """

    whole: torch.Tensor
    uploads: dict
    step: torch.Tensor
    append_index: torch.Tensor
    rows: torch.Tensor
    cached: torch.Tensor
    device: torch.Tensor
    page_slot: torch.Tensor
    token_index: torch.Tensor
    out_loc: torch.Tensor
    input_ids: torch.Tensor
    host: HostViews
    launches: dict


def make_slot_views(device_buffer: torch.Tensor, host_buffer: torch.Tensor, batch_size: int) -> SlotViews:
    """The views of a slot's buffers: ``device_buffer`` int32 with at least ``device_size``
    entries, ``host_buffer`` int32, zeroed, ``host_size`` entries (this batch size's own)."""
    n = batch_size
    sizes = (3 * n + 1, 4 * n + 1, 6 * n + 2)
    array = host_buffer.numpy()
    _, _, h_cached, h_device, _, h_indptr, h_last = host_buffer.split_with_sizes((1, n, n, n, n, n + 1, n))
    host = HostViews(
        host_buffer, {size: host_buffer[:size] for size in sizes}, array[:1], array[1 : n + 1],
        array[n + 1 : 2 * n + 1], array[2 * n + 1 : 3 * n + 1], array[3 * n + 1 : 4 * n + 1],
        array[4 * n + 2 : 5 * n + 2], array[5 * n + 2 :], h_cached, h_device, h_indptr, h_last,
    )
    whole = device_buffer[: device_size(n)]
    append, step, rows, cached, device, page_slot, _lists, token_index, out_loc, input_ids = whole.split_with_sizes(
        (2 * n, 1, n, n, n, n, 2 * n + 1, n, n, n)
    )
    uploads = {size: whole[2 * n : 2 * n + size] for size in sizes}
    return SlotViews(
        whole, uploads, step, append.view(torch.int64), rows, cached, device, page_slot, token_index, out_loc,
        input_ids, host, {},
    )


def derive_with_torch(
    views: SlotViews,
    flat_table: torch.Tensor,
    flat_tokens: torch.Tensor,
    row_width: int,
    page_size: int,
    storage: torch.Tensor | None,
    append_values: torch.Tensor | None,
) -> None:
    """What the decode-step kernel does, in torch ops (CPU tables used through torch, or no
    Triton): with ``storage`` (deferred pages), first each page slot's page into the table at
    its request's cached length, clipped to the row; then token index, out_loc and append index;
    then the input ids - with ``append_values`` (the previous step's deferred appends, one per
    request, bound for each request's token cell) written into the token pool first.

    Args:
        flat_table: shape ``[rows * row_width]``, int32, device; the page table, flat.
        flat_tokens: shape ``[rows * row_width]``, int32, device; the token pool, flat.
        storage: int32, device; the free list's tensor the page slots index.
        append_values: shape ``[n]``, int32, device, contiguous.
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
    if append_values is not None:
        flat_tokens.index_put_((views.token_index,), append_values)
        views.input_ids.copy_(append_values)
    else:
        torch.index_select(flat_tokens, 0, views.token_index, out=views.input_ids)
