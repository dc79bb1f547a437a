"""``DecodeStager``: a decode step's ``AttentionBatch`` for a page table used through torch (a
GPU's), at the fewest host-side calls.

On the H200 hosts every torch call costs 2-19 us of host time whatever its size, so the per-step
cost is the number of calls. A step here makes: a few numpy writes into a persistent pinned host
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
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
import numpy as np
import torch

from kvplug.attention.decode_batch import ExtendStarts
from kvplug.attention.decode_slot import SlotViews, derive_with_torch, device_size, host_size, make_slot_views
from kvplug.attention.paged_indices import PagedIndexBuilder, PagedIndices, write_page_list_arrays
from kvplug.attention.step_progress import StepProgress
from kvplug.interface import AttentionBatch, ForwardPhase
from kvplug.memory.allocator import NewPages


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
        np.add(host.cached, 1, out=host.device)  # int32 to int32: no cast
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
