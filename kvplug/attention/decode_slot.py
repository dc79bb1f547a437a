"""The decode slot layout, defined once: the fields of a staged decode step in one pinned host
buffer and one device buffer, their offsets for a batch of ``n``, and the views made from them.

``HOST_FIELDS`` and ``DEVICE_FIELDS`` below are the only description of the layout: the numpy and
torch views a step writes and a batch carries (``make_slot_views``), the torch fallback
(``derive_with_torch``) and the decode-step kernel's offset arguments
(``triton_kernels.decode_step.bind_decode_step`` takes ``SlotOffsets``) are all built from them.

A field's length is ``per_request * n + extra`` int32 entries. The host buffer (pinned for a GPU
table; one per ring slot and batch size, so fields written once stay: ``indptr[0] = 0``, the
token view's last-page lengths of 1) is written by the host each step and read in place by the
kernel (pinned memory is device-accessible). The device buffer starts with the int64 append
index (8-byte aligned at offset 0), then mirrors the host buffer (so the torch path uploads its
leading part with one copy), then the fields derived on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

#: (name, per_request, extra) in buffer order; the host buffer a step writes.
HOST_FIELDS: tuple[tuple[str, int, int], ...] = (
    ("step", 0, 1),  # the step number the launch reports back (``StepProgress``)
    ("rows", 1, 0),  # table rows (padding: the dummy row)
    ("cached", 1, 0),  # cached lengths = the new tokens' positions
    ("device", 1, 0),  # device lengths = cached + 1
    ("page_slot", 1, 0),  # first location of a new page, or -1
    ("indptr", 1, 1),  # page-list CSR offsets (``indptr[0] == 0``)
    ("last_page_len", 1, 0),  # tokens in each request's last page-list page
)
#: (name, per_request, extra) in buffer order; the device buffer the batch's tensors view.
DEVICE_FIELDS: tuple[tuple[str, int, int], ...] = (
    ("append_index", 2, 0),  # int64: the cell after each new token (where its sampled id goes)
    *HOST_FIELDS,  # uploaded as one block by the torch path; the kernel writes rows/cached/device
    ("token_index", 1, 0),  # row * row_width + cached: the new token's cell in table and token pool
    ("out_loc", 1, 0),  # the new token's pool location
    ("input_ids", 1, 0),  # the token pool at the token index: the forward's input ids
)
#: fields the torch path uploads, by what the step carries (the leading part of the host buffer)
UPLOADED = {"plain": "device", "pages": "page_slot", "page_lists": "last_page_len"}


def field_offsets(fields: tuple[tuple[str, int, int], ...], n: int) -> dict[str, tuple[int, int]]:
    """``name -> (start, length)`` in int32 entries for a batch of ``n``."""
    offsets, start = {}, 0
    for name, per_request, extra in fields:
        length = per_request * n + extra
        offsets[name] = (start, length)
        start += length
    return offsets


def host_size(n: int) -> int:
    """int32 entries of the host buffer for a batch of ``n``."""
    return sum(per_request * n + extra for _, per_request, extra in HOST_FIELDS)


def device_size(n: int) -> int:
    """int32 entries of the device buffer for a batch of ``n``."""
    return sum(per_request * n + extra for _, per_request, extra in DEVICE_FIELDS)


def upload_size(n: int, kind: str) -> int:
    """int32 entries the torch path copies from the host buffer's start (``kind``: a key of ``UPLOADED``)."""
    start, length = field_offsets(HOST_FIELDS, n)[UPLOADED[kind]]
    return start + length


class SlotOffsets(NamedTuple):
    """The kernel's offset arguments for a batch of ``n`` (int32 entries from each buffer's start)."""

    host_rows: int
    host_cached: int
    host_device: int
    host_page_slot: int
    host_indptr: int
    rows: int
    cached: int
    device: int
    token_index: int
    out_loc: int
    input_ids: int

    @classmethod
    def for_batch(cls, n: int) -> "SlotOffsets":
        host, device = field_offsets(HOST_FIELDS, n), field_offsets(DEVICE_FIELDS, n)
        return cls(
            *(host[name][0] for name in ("rows", "cached", "device", "page_slot", "indptr")),
            *(device[name][0] for name in ("rows", "cached", "device", "token_index", "out_loc", "input_ids")),
        )


class HostViews(NamedTuple):
    """The host buffer's fields for one batch size ``n``: numpy views the step writes (int32) and
    torch views of the same memory the batch carries (shape ``[n]`` unless noted).

    Attributes:
        whole: shape ``[host_size(n)]``; the buffer (the kernel's argument).
        uploads: upload kind -> the leading part of the buffer the torch path copies.
        step: shape ``[1]``; rows, cached, device, page_slot, page_ends (``indptr[1:]``),
            last_array: numpy.
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
        whole: shape ``[device_size(n)]``; the kernel's argument.
        uploads: upload kind -> the part of ``whole`` the host buffer's leading part is copied into.
        step: shape ``[1]``; the step number copied in (torch path).
        append_index: int64.
        input_ids: the token ids at the token index.
        offsets: the kernel's ``SlotOffsets``.
        launches: bound kernel launches, by (new pages?, pending tokens?).
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
    offsets: SlotOffsets
    launches: dict


def make_slot_views(device_buffer: torch.Tensor, host_buffer: torch.Tensor, n: int) -> SlotViews:
    """The views of a slot's buffers: ``device_buffer`` int32 with at least ``device_size(n)``
    entries, ``host_buffer`` int32, zeroed, ``host_size(n)`` entries (this batch size's own)."""
    array = host_buffer.numpy()
    host_at = field_offsets(HOST_FIELDS, n)

    def numpy_field(name: str) -> np.ndarray:
        start, length = host_at[name]
        return array[start : start + length]

    def torch_field(name: str) -> torch.Tensor:
        start, length = host_at[name]
        return host_buffer[start : start + length]

    page_ends = numpy_field("indptr")[1:]
    host = HostViews(
        host_buffer, {kind: host_buffer[: upload_size(n, kind)] for kind in UPLOADED},
        numpy_field("step"), numpy_field("rows"), numpy_field("cached"), numpy_field("device"),
        numpy_field("page_slot"), page_ends, numpy_field("last_page_len"),
        torch_field("cached"), torch_field("device"), torch_field("indptr"), torch_field("last_page_len"),
    )
    whole = device_buffer[: device_size(n)]
    device_at = field_offsets(DEVICE_FIELDS, n)

    def device_field(name: str) -> torch.Tensor:
        start, length = device_at[name]
        return whole[start : start + length]

    mirror = device_at["step"][0]
    return SlotViews(
        whole, {kind: whole[mirror : mirror + upload_size(n, kind)] for kind in UPLOADED},
        device_field("step"), device_field("append_index").view(torch.int64),
        *(device_field(name) for name in ("rows", "cached", "device", "page_slot", "token_index", "out_loc")),
        device_field("input_ids"), host, SlotOffsets.for_batch(n), {},
    )


def derive_with_torch(
    views: SlotViews,
    flat_table: torch.Tensor,
    flat_tokens: torch.Tensor,
    row_width: int,
    page_size: int,
    with_pages: bool,
    pending_tokens: torch.Tensor | None,
) -> None:
    """What the decode-step kernel does, in torch ops (CPU tables, or no Triton), after the
    upload: ``with_pages``, first each new page (its first location in the ``page_slot`` field)
    into the table at its request's cached length, clipped to the row; then token index, out_loc and
    append index; then the input ids - with ``pending_tokens`` (the previous step's committed
    ids, one per live request, bound for each request's token cell) written into the token pool
    first.

    Args:
        flat_table: shape ``[rows * row_width]``, int32, device; the page table, flat.
        flat_tokens: shape ``[rows * row_width]``, int32, device; the token pool, flat.
        pending_tokens: shape ``[live]``, int32, device, contiguous; ``live <= n`` (padding last).
    """
    if with_pages:
        slots = views.page_slot
        growing = (slots >= 0).nonzero().squeeze(1)
        starts = views.rows[growing].long() * row_width + views.cached[growing]
        pages = slots[growing]
        offsets = torch.arange(page_size, device=flat_table.device)
        inside = (views.cached[growing, None] + offsets) < row_width
        cells = (starts[:, None] + offsets)[inside]
        flat_table[cells] = (pages[:, None] + offsets)[inside].to(torch.int32)
    torch.add(views.cached, views.rows, alpha=row_width, out=views.token_index)
    torch.index_select(flat_table, 0, views.token_index, out=views.out_loc)
    torch.add(views.token_index, 1, out=views.append_index)
    if pending_tokens is not None:
        live = pending_tokens.shape[0]
        flat_tokens.index_put_((views.token_index[:live],), pending_tokens)
    torch.index_select(flat_tokens, 0, views.token_index, out=views.input_ids)
