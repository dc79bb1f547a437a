"""``DecodeStager``: a decode step's ``AttentionBatch`` for a page table used through torch (a
GPU's), at the fewest host-side calls.

On the H200 hosts every torch call costs 3-19 us of host time whatever its size, so the per-step
cost is the number of calls. A step here makes: one pinned host buffer (three numpy writes: rows,
cached lengths, device lengths), one copy into a device *slot*, and one kernel launch that
derives the rest on the device (``triton_kernels.decode_step``; three torch ops off CUDA or
without Triton). The slot's views (rows, cached, device, token index, out_loc, append index) are
made once per slot and batch size, so no split or slicing happens per step.

Slots form a ring (``ring_size``, default 3): a batch's device tensors are reused by the decode
batch staged ``ring_size`` prepares later. Work enqueued on the same stream before that is safe
(the copy that overwrites a slot is ordered after it); a host must not hold a decode batch for
longer than that (hosts describe one forward per batch). ``build_decode_batch`` and
``build_attention_batch`` still return batches that own their tensors.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import numpy as np
import torch

from kvplug.attention.decode_batch import ExtendStarts, host_buffer
from kvplug.interface import AttentionBatch, ForwardPhase
from kvplug.memory.deferred_pages import DeferredPages


class DecodeUpload(NamedTuple):
    """A decode batch and the two flat indices staged with it.

    Attributes:
        batch: the ``AttentionBatch``.
        token_index: shape ``[bs]``, int32, table device; ``row * row_width + cached_len``, the
            cell of each request's new token in the page table and the token pool (``input_ids``).
        append_index: shape ``[bs]``, int64, table device; the next cell, where the sampled token
            goes (``append_tokens``).
        device_lens_host: shape ``[bs]``, int32, host (numpy); ``cached_len + 1``, the column of
            that next cell (``append_tokens`` checks it against the requests it is given).
    """

    batch: AttentionBatch
    token_index: torch.Tensor
    append_index: torch.Tensor
    device_lens_host: np.ndarray


class _SlotViews(NamedTuple):
    """Views of one ring slot for one batch size ``n`` (int32 unless noted)."""

    whole: torch.Tensor  # [8n]: append index (int64, 2n) | rows | cached | device | page slot | token index | out_loc
    upload: torch.Tensor  # [3n]: rows | cached | device, what the host copies in
    upload_with_pages: torch.Tensor  # [4n]: the same and the page slots
    append_index: torch.Tensor  # [n], int64
    rows: torch.Tensor
    cached: torch.Tensor
    device: torch.Tensor
    page_slot: torch.Tensor
    token_index: torch.Tensor
    out_loc: torch.Tensor
    launches: dict  # bound kernel launches: False -> without pages, True -> with (given the pages tensor)


class DecodeStager:
    """Stages decode batches over ``page_table`` (see the module docstring).

    Args:
        page_table: shape ``[max_running_reqs + 1, row_width]``, int32, contiguous, device.
        page_size: tokens per page of the pool (deferred pages are written page by page).
        ring_size: device slots in the ring (>= 1).
        use_kernel: derive on the device with the Triton kernel; ``None``: when the table is on
            CUDA and Triton is importable.
    """

    def __init__(
        self, page_table: torch.Tensor, *, page_size: int = 1, ring_size: int = 3, use_kernel: bool | None = None
    ) -> None:
        self.page_table = page_table
        self.page_size = int(page_size)
        self.device = page_table.device
        self.ring_size = int(ring_size)
        self._flat_table = page_table.view(-1)
        self._capacity = page_table.shape[0]  # the largest batch: every row, dummy included
        self._slots: list[torch.Tensor | None] = [None] * self.ring_size
        self._views: dict[tuple[int, int], _SlotViews] = {}
        self._next = 0
        self.extend_starts = ExtendStarts(self.device)
        if use_kernel is None:
            use_kernel = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self._bind_kernel = None
        if use_kernel:
            from kvplug.attention.triton_kernels.decode_step import bind_decode_fields

            self._bind_kernel = bind_decode_fields

    def stage(
        self, table_rows: np.ndarray, cached_lens: np.ndarray, *, num_padded: int = 0,
        deferred: DeferredPages | None = None,
    ) -> DecodeUpload:
        """The ``DECODE`` batch of ``build_attention_batch`` for ``device_lens = cached_lens + 1``,
        without validation (the caller guarantees what it checks), and the step's flat indices.

        Args:
            table_rows: shape ``[bs]``, integers, host (numpy); live rows, distinct, padding on
                the dummy row.
            cached_lens: shape ``[bs]``, integers, host (numpy); ``0 <= cached_len < row_width``.
            num_padded: trailing requests that are CUDA-graph padding.
            deferred: pages the allocator took for this batch but did not write
                (``PagedAllocator.take_deferred_pages``): each goes into the table at its
                request's ``cached_len`` before ``out_loc`` is read.
        """
        n = table_rows.shape[0]
        slot = self._next
        self._next = slot + 1 if slot + 1 < self.ring_size else 0
        views = self._views.get((slot, n)) or self._make_views(slot, n)
        parts = 3 if deferred is None else 4
        host_tensor = host_buffer(parts * n, self.device)
        block = host_tensor.numpy().reshape(parts, n)
        block[0] = table_rows
        block[1] = cached_lens
        np.add(cached_lens, 1, out=block[2], casting="unsafe")
        if deferred is None:
            views.upload.copy_(host_tensor, non_blocking=True)
            self._derive(views, n, None)
        else:
            block[3] = deferred.page_slot
            views.upload_with_pages.copy_(host_tensor, non_blocking=True)
            self._derive(views, n, deferred.storage)
        d_start, h_start = self.extend_starts.get(n)
        # host views of the pinned buffer (which they keep alive); from_numpy is the cheapest way
        h_cached, h_device = torch.from_numpy(block[1]), torch.from_numpy(block[2])
        batch = AttentionBatch(
            ForwardPhase.DECODE, views.rows, views.cached, views.device, h_cached, h_device, d_start, h_start,
            views.cached, views.out_loc, self.page_table, num_padded,
        )
        return DecodeUpload(batch, views.token_index, views.append_index, block[2])

    def _make_views(self, slot: int, n: int) -> _SlotViews:
        buffer = self._slots[slot]
        if buffer is None or buffer.numel() < 8 * n:  # padded batches may repeat the dummy row
            # views made earlier keep the old buffer alive, so their batches stay valid
            size = 8 * max(self._capacity, n)
            buffer = self._slots[slot] = torch.zeros(size, dtype=torch.int32, device=self.device)
        whole = buffer[: 8 * n]
        append, rows, cached, device, page_slot, token_index, out_loc = whole.split_with_sizes((2 * n,) + (n,) * 6)
        views = _SlotViews(
            whole, whole[2 * n : 5 * n], whole[2 * n : 6 * n], append.view(torch.int64), rows, cached, device,
            page_slot, token_index, out_loc, {},
        )
        self._views[(slot, n)] = views
        return views

    def _derive(self, views: _SlotViews, n: int, storage: torch.Tensor | None) -> None:
        """Token index, out_loc and append index from the uploaded rows and cached lengths; with
        ``storage`` (deferred pages), first each page slot's page into the table at its request's
        cached length."""
        if self._bind_kernel is None:
            derive_with_torch(views, self._flat_table, self.page_table.shape[1], self.page_size, storage)
            return
        with_pages = storage is not None
        launch = views.launches.get(with_pages)
        if launch is None:
            launch = views.launches[with_pages] = self._bind_kernel(
                views.whole, views.append_index, self.page_table, n, self.page_size, with_pages=storage
            )
        if with_pages:
            launch(storage)
        else:
            launch()


def derive_with_torch(
    views: _SlotViews, flat_table: torch.Tensor, row_width: int, page_size: int, storage: torch.Tensor | None
) -> None:
    """What the decode-step kernel does, in torch ops (CPU tables used through torch, or no Triton);
    the GPU tests hold the kernel to it."""
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
