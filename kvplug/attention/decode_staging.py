"""``DecodeStager``: a decode step's ``AttentionBatch`` for a page table used through torch (a
GPU's), at the fewest host-side calls.

Every torch call costs host time whatever its size, so the per-step cost is the number of calls. A step here makes: a few numpy writes into a persistent pinned host
buffer (rows, cached lengths, device lengths; new pages' slots; page-list ``indptr`` and
last-page lengths) and one kernel launch that reads it in place and derives the rest on the
device (``triton_kernels.decode_step``; a copy and torch ops off CUDA or without Triton): the
new pages go into the page table, and the step's input ids are gathered - after the previous
step's committed ids went into the token pool, when the caller hands them over
(``kvplug.decode_step``). Both buffers and every view of them (the batch's host fields
included) are made once per ring slot and batch size (``decode_slot``), so a step allocates and
slices nothing.

Page lists: an attention backend that plans decode batches with FlashInfer-style CSR page lists
says so (``decode_page_list_size``, the tokens per page of its view); a stager built with that
size writes them in the same launch and hands them over on the batch
(``StagedDecodeBatch.page_lists``), so the backend's ``prepare_metadata`` builds nothing.

Slots form a ring (``ring_size``, default 3): a batch's tensors, host and device, are reused by
the decode batch staged ``ring_size`` prepares later; a host must not hold a decode batch for
longer than that (hosts describe one forward per batch). Device work is safe by stream order (the
copy that overwrites a slot is ordered after every earlier use). Host memory is not: the copy and
``plan()``'s copies read it asynchronously. So each launch writes its step number into pinned
host memory (``StepProgress``), and a slot's host buffer is rewritten only once the device
reported the step after that slot's last use - a wait (a stream sync) only when the host runs
``ring_size - 1`` steps ahead of the device. Everything runs on the current stream.
``build_decode_batch`` and ``build_attention_batch`` still return batches that own their tensors.

CUDA graphs: ``stage(..., static=True)`` writes the device fields into one fixed buffer per batch
size instead of the ring's, so a graph captured over that batch replays over every later step of
the size (the host buffers still rotate through the ring).

The slot layout (defined once, below): the fields of a staged decode step in one pinned host
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

Step progress (below, ``StepProgress``): how far the device has come through a ring of staged steps, read on the host
without a sync.

A ring reuses host memory that the device reads asynchronously (a copy's source, ``plan()``'s
copies), so the host may rewrite a slot only after the device passed every read of its last use.
Each staged step carries a number; the step's launch, on the stream after every earlier step's
reads, writes that number into one pinned, device-accessible int32 (``tensor``). Reading it is a
numpy load: no CUDA call. The host waits (a stream sync) only when the device is ``ring_size - 1``
steps behind. Numbers are 31 bits and compared modulo 2**31, so a long-running server never
overflows them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvplug.attention.decode_batch import ExtendStarts
from kvplug.attention.paged_indices import PagedIndexBuilder, PagedIndices, write_page_list_arrays
from kvplug.interface import AttentionBatch, ForwardPhase, KVPlugError
from kvplug.memory.allocator import NewPages

# NOTE: 1 as a read-only 0-d int32 array for the per-step device lengths: numpy handles an array
# operand faster than a Python int, whose dtype it works out on every call
_ONE32 = np.array(1, dtype=np.int32)
_ONE32.flags.writeable = False


# ---------------------------------------------------------------------- the slot layout

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


# ---------------------------------------------------------------------- step progress

_MASK = (1 << 31) - 1
_HALF = 1 << 30


class StepProgressError(KVPlugError, RuntimeError):
    """The device did not report a step it must have run (a launch that does not write progress)."""


class StepProgress:
    """Step numbers of one ring of ``ring_size`` slots on ``device``.

    Attributes:
        tensor: shape ``[1]``, int32, cpu (pinned for CUDA); the last step number the device
            reported (a kernel argument, or a copy's destination).
    """

    def __init__(self, device: torch.device, ring_size: int) -> None:
        self.device = device
        self.ring_size = int(ring_size)
        self.tensor = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._reported = self.tensor.numpy()
        self._staged = 0  # steps begun so far

    def begin_step(self) -> int:
        """The next step's number, once the slot it takes is free on the host: the device has
        reported the step after that slot's last use (``ring_size`` steps back)."""
        step = self._staged = self._staged + 1
        needed = step - self.ring_size + 1
        if needed > 1 and not self.reached(needed):
            self._wait_for()
        return step & _MASK

    def reached(self, step: int) -> bool:
        """Whether the device reported ``step`` (or a later one)."""
        return ((int(self._reported[0]) - (step & _MASK)) & _MASK) < _HALF

    def report(self, step: torch.Tensor) -> None:
        """Report through a stream-ordered copy (paths without the kernel): ``step`` is shape
        ``[1]``, int32, on ``device``, holding the step's number."""
        self.tensor.copy_(step, non_blocking=True)

    def _wait_for(self) -> None:
        """Sync the stream: every read of the slot has then run. The previous step must have
        reported by then (a ring of one slot never sees its own step's report in time)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if not self.reached(self._staged - 1):
            raise StepProgressError(
                f"the device reported step {int(self._reported[0])} after a sync; expected at least "
                f"{(self._staged - 1) & _MASK} (every staged step's launch must report its number)"
            )


# ---------------------------------------------------------------------- the stager


@dataclass
class StagedDecodeBatch(AttentionBatch):
    """An ``AttentionBatch`` staged by ``DecodeStager``, with the page lists it was asked for and
    the fields derived with it.

    Attributes:
        page_lists: the batch's CSR page lists for a view of ``page_lists.view_page_size`` tokens
            a page over ``page_table`` (views of the slot's buffers, valid as long as the batch's
            other fields), or ``None`` when the stager builds none.
        input_ids: shape ``[bs]``, int32, device; the token pool at each request's new-token
            cell (after the step's pending tokens went there): the forward's input ids.
        append_index: shape ``[bs]``, int64, device; the cell after each new token, where its
            sampled id goes.
    """

    page_lists: PagedIndices | None = None
    input_ids: torch.Tensor | None = None
    append_index: torch.Tensor | None = None


class DecodeStager:
    """Stages decode batches over ``page_table`` (see the module docstring).

    Args:
        page_table: shape ``[max_running_reqs + 1, row_width]``, int32, contiguous, device.
        token_pool: same shape, int32, contiguous, device; read for each batch's input ids, and
            written with a step's pending tokens.
        page_size: tokens per page of the pool (new pages are written page by page).
        page_list_size: build each batch's CSR page lists for a view of this many tokens a page
            (1, or ``page_size``); ``None``: none.
        ring_size: device slots in the ring (>= 1).
        use_kernel: derive on the device with the Triton kernel; ``None``: when the table is on
            CUDA and Triton is importable.
    """

    def __init__(
        self,
        page_table: torch.Tensor,
        token_pool: torch.Tensor,
        *,
        page_size: int = 1,
        page_list_size: int | None = None,
        ring_size: int = 3,
        use_kernel: bool | None = None,
    ) -> None:
        self.page_table = page_table
        self.page_size = int(page_size)
        self.page_list_size = None if page_list_size is None else int(page_list_size)
        self.device = page_table.device
        self.ring_size = int(ring_size)
        self._flat_table = page_table.view(-1)
        self._flat_tokens = token_pool.view(-1)
        self._capacity = page_table.shape[0]  # the largest batch: every row, dummy included
        self._buffers: list[torch.Tensor | None] = [None] * self.ring_size  # device buffers
        self._static_buffers: dict[int, torch.Tensor] = {}  # batch size -> a graph's fixed buffer
        self._list_buffers = [torch.empty(0, dtype=torch.int32, device=self.device) for _ in range(self.ring_size)]
        self._list_capacity = [0] * self.ring_size  # entries of each list buffer, kept as ints
        self._views: dict[tuple[int, int, bool], SlotViews] = {}
        self._next = 0
        self.progress = StepProgress(self.device, self.ring_size)
        self.extend_starts = ExtendStarts(self.device)
        if use_kernel is None:
            use_kernel = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self._bind_kernel = None
        self._list_builder = None
        if use_kernel:
            from kvplug.attention.triton_kernels.decode_step import bind_decode_step

            self._bind_kernel = bind_decode_step
        elif self.page_list_size is not None:
            self._list_builder = PagedIndexBuilder(page_table, self.page_list_size, use_kernel=False)

    def stage(
        self, table_rows: np.ndarray, cached_lens: np.ndarray, *, pages: NewPages | None = None,
        tokens: torch.Tensor | None = None, pad_to: int | None = None,
    ) -> StagedDecodeBatch:
        """The ``DECODE`` batch of ``build_attention_batch`` for ``device_lens = cached_lens + 1``,
        without validation (the caller guarantees what it checks), with its input ids and
        append index.

        Args:
            table_rows: shape ``[live]``, integers, host (numpy); live rows, distinct.
            cached_lens: shape ``[live]``, integers, host (numpy); ``0 <= cached_len < row_width``.
            pages: the new pages of the step's requests (``page_start`` of shape ``[live]``,
                a page's first location or -1): each goes into the table at its request's
                ``cached_len`` before ``out_loc`` (and the page lists) are read.
            tokens: shape ``[live]``, int32, device, contiguous; token ids that belong at each
                request's token cell (``row * row_width + cached_len``) but are not in the token
                pool yet (the previous step's commit): written there in this step's launch, and
                they are its input ids.
            pad_to: stage a batch of this size (``>= live``) into its fixed device buffer (the
                one a CUDA graph captured for it reads) instead of the ring's, the requests
                after the live ones being the dummy request (dummy row, cached length 0).
        """
        live = table_rows.shape[0]
        n = live if pad_to is None else pad_to
        static = pad_to is not None
        slot = self._next
        self._next = slot + 1 if slot + 1 < self.ring_size else 0
        views = self._views.get((slot, n, static)) or self._make_views(slot, n, static)
        host = views.host
        host.step[0] = self.progress.begin_step()  # waits if this slot's host buffer may still be read
        if live == n:
            host.rows[:] = table_rows
            host.cached[:] = cached_lens
        else:
            host.rows[:live] = table_rows
            host.rows[live:] = self._capacity - 1  # the dummy row
            host.cached[:live] = cached_lens
            host.cached[live:] = 0
        np.add(host.cached, _ONE32, out=host.device)  # int32 to int32: no cast
        if pages is not None:
            host.page_slot[:live] = pages.page_start
            if live != n:
                host.page_slot[live:] = -1
        list_size = self.page_list_size
        page_lists = None
        if list_size is not None:
            last = None if list_size == 1 else host.last_array  # the token view's stays all ones
            total_pages = write_page_list_arrays(host.device, list_size, host.page_ends, last, host.cached)
            if self._list_capacity[slot] < total_pages and self._bind_kernel is not None:
                self._grow_list_buffer(slot, total_pages)
        self._derive(views, slot, n, pages is not None, tokens)
        if list_size is not None:
            if self._list_builder is not None:
                indices = self._list_builder.build(views.rows, host.device_lens).indices
            else:
                indices = self._list_buffers[slot][:total_pages]
            page_lists = PagedIndices(host.indptr, host.last_page_len, indices, list_size)
        d_start, h_start = self.extend_starts.get(n)
        return StagedDecodeBatch(
            ForwardPhase.DECODE, views.rows, views.cached, views.device, host.cached_lens, host.device_lens,
            d_start, h_start, views.cached, views.out_loc, self.page_table, n - live, None, None, page_lists,
            views.input_ids, views.append_index,
        )

    def _make_views(self, slot: int, n: int, static: bool) -> SlotViews:
        if static:
            # one fixed buffer per batch size, whatever the ring slot: a captured graph reads it
            buffer = self._static_buffers.get(n)
            if buffer is None:
                buffer = self._static_buffers[n] = torch.zeros(device_size(n), dtype=torch.int32, device=self.device)
        else:
            buffer = self._buffers[slot]
            if buffer is None or buffer.numel() < device_size(n):  # padded batches may repeat the dummy row
                # views made earlier keep the old buffer alive, so their batches stay valid
                buffer = self._buffers[slot] = torch.zeros(
                    device_size(max(self._capacity, n)), dtype=torch.int32, device=self.device
                )
        host = torch.zeros(host_size(n), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        views = self._views[(slot, n, static)] = make_slot_views(buffer, host, n)
        views.host.last_array[:] = 1  # the token view's last pages, written once
        return views

    def _grow_list_buffer(self, slot: int, total_pages: int) -> None:
        """A bigger page-list buffer for ``slot``: launches bound to the old one go (batches
        holding views of it keep it alive)."""
        capacity = self._list_capacity[slot] = 1 << (total_pages - 1).bit_length()
        self._list_buffers[slot] = torch.empty(capacity, dtype=torch.int32, device=self.device)
        for (views_slot, _, _), views in self._views.items():
            if views_slot == slot:
                views.launches.clear()

    def _derive(self, views: SlotViews, slot: int, n: int, with_pages: bool, tokens: torch.Tensor | None) -> None:
        """The batch fields in the device buffer, token index, out_loc, append index and input ids
        (and page lists) from the host buffer; ``with_pages``: first each new page (the host
        buffer's ``page_slot`` field holds its first location) into the table at its request's
        cached length; with ``tokens``, those ids into the token pool first. Then the step
        number goes to ``progress``. The kernel reads the pinned host buffer in place; the torch
        path copies it."""
        if self._bind_kernel is None:
            kind = "page_lists" if self.page_list_size is not None else ("pages" if with_pages else "plain")
            views.uploads[kind].copy_(views.host.uploads[kind], non_blocking=True)
            derive_with_torch(
                views, self._flat_table, self._flat_tokens, self.page_table.shape[1], self.page_size, with_pages, tokens
            )
            self.progress.report(views.step)
            return
        kind = (with_pages, tokens is not None)
        launch = views.launches.get(kind)
        if launch is None:
            page_lists = None if self.page_list_size is None else (self._list_buffers[slot], self.page_list_size)
            launch = views.launches[kind] = self._bind_kernel(
                views.whole, views.host.whole, views.append_index, views.offsets, self.page_table, self._flat_tokens,
                n, self.page_size, self.progress.tensor, with_pages=with_pages, with_tokens=tokens,
                page_lists=page_lists,
            )
        if tokens is None:
            launch()
        else:
            launch(tokens, tokens.shape[0])
