"""Page-table rows to the CSR page lists that FlashInfer-style kernels take, on the device.

For a view of the pool with page size ``S`` (1 for the token view, P for the page view), request
``i`` owns ``pages_i = ceil(device_len_i / S)`` pages whose indices are
``page_table[row_i, j * S] // S`` for ``j < pages_i``. Only O(batch) work happens on the host (the
host-side ``indptr`` and last-page lengths ``plan()`` takes); the O(tokens) gather happens on the
device with no sync: on CUDA one Triton launch (``triton_kernels.page_lists``), elsewhere (or
without Triton) four torch ops, which the kernel is tested against.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import numpy as np
import torch

from kvplug.attention.batch import host_buffer
from kvplug.interface import InvalidArgumentError


class PagedIndices(NamedTuple):
    """Attributes:
        indptr: shape ``[bs + 1]``, int32, cpu; exclusive prefix sum of pages per request.
        last_page_len: shape ``[bs]``, int32, cpu; tokens in each request's last page (1..S).
        indices: shape ``[indptr[-1]]``, int32, table device; page numbers of the view.
        view_page_size: ``S``, tokens per page of the view the page numbers count in.
    """

    indptr: torch.Tensor
    last_page_len: torch.Tensor
    indices: torch.Tensor
    view_page_size: int


def write_page_list_arrays(
    device_lens: np.ndarray,
    view_page_size: int,
    page_ends: np.ndarray,
    last_page_len: np.ndarray | None,
    last_positions: np.ndarray | None = None,
) -> int:
    """Fills the host arrays ``plan()`` takes (``indptr = [0, *page_ends]``) and returns the
    batch's total pages. Every numpy call costs microseconds of host time on a GPU host, so the
    token view skips what it can.

    Args:
        device_lens: shape ``[bs]``, integers, host (numpy); each >= 1.
        view_page_size: ``S``.
        page_ends: shape ``[bs]``, int32, host (numpy), written: ``indptr[1:]``, the inclusive
            prefix sum of ``ceil(device_len / S)`` (the caller's ``indptr[0]`` holds 0).
        last_page_len: shape ``[bs]``, int32, host (numpy), written: ``(device_len - 1) % S + 1``;
            ``None`` for the token view (``S == 1``) when it already holds ones.
        last_positions: ``device_lens - 1`` from a caller that has it (a decode batch's cached
            lengths).
    """
    # np.add.accumulate, not np.cumsum: the same sum at half the call overhead
    if view_page_size == 1:  # token view: a page per token, every last page holds one
        np.add.accumulate(device_lens, out=page_ends)
        if last_page_len is not None:
            last_page_len[:] = 1
    else:
        if last_positions is None:
            last_positions = device_lens - 1
        # pages = last_position // S + 1 and last_page_len = last_position % S + 1, in place
        if view_page_size & (view_page_size - 1) == 0:  # a power of two: shift and mask
            np.right_shift(last_positions, view_page_size.bit_length() - 1, out=page_ends)
            np.bitwise_and(last_positions, view_page_size - 1, out=last_page_len)
        else:
            np.divmod(last_positions, view_page_size, out=(page_ends, last_page_len))
        page_ends += 1
        np.add.accumulate(page_ends, out=page_ends)
        last_page_len += 1
    return int(page_ends[-1]) if page_ends.shape[0] else 0


class PagedIndexBuilder:
    """Builds ``PagedIndices`` over ``page_table`` for a view with ``view_page_size`` tokens a page.

    Args:
        page_table: shape ``[rows, row_width]``, int32, contiguous, device.
        view_page_size: 1 (token view) or the pool's page size (page view).
        use_kernel: build the page lists with the Triton kernel (``PageListWriter``: results
            stay valid for 3 builds, as decode batches do); ``None``: when the table is on CUDA
            and Triton is importable.
    """

    def __init__(self, page_table: torch.Tensor, view_page_size: int, *, use_kernel: bool | None = None) -> None:
        if not page_table.is_contiguous():
            raise InvalidArgumentError("page_table must be contiguous")
        self.page_table = page_table
        self.view_page_size = int(view_page_size)
        self._flat_table = page_table.view(-1)
        self._strided_arange = torch.empty(0, dtype=torch.int32, device=page_table.device)
        if use_kernel is None:
            use_kernel = page_table.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self._kernel = None
        if use_kernel:
            from kvplug.attention.triton_kernels.page_lists import PageListWriter

            self._kernel = PageListWriter(page_table, self.view_page_size).write

    def _page_offsets(self, total: int) -> torch.Tensor:
        """``[0, S, 2S, ...]`` of length ``total``: shape ``[total]``, int32, device."""
        if self._strided_arange.numel() < total:
            size = 1 << max(total - 1, 1).bit_length()
            self._strided_arange = torch.arange(
                0, size * self.view_page_size, self.view_page_size, dtype=torch.int32, device=self.page_table.device
            )
        return self._strided_arange[:total]

    def build(
        self, table_rows: torch.Tensor, device_lens_cpu: torch.Tensor, device_lens: torch.Tensor | None = None
    ) -> PagedIndices:
        """Args:
            table_rows: shape ``[bs]``, int32, device.
            device_lens_cpu: shape ``[bs]``, int32, cpu; each >= 1.
            device_lens: shape ``[bs]``, int32, device; the same values (a batch has both), read
                by the kernel; uploaded from ``device_lens_cpu`` when not given.
        """
        size = self.view_page_size
        bs = device_lens_cpu.shape[0]
        # indptr | last_page_len, and for the torch path: pages | -S * indptr[:-1]
        host_tensor = host_buffer(2 * bs + 1 + (0 if self._kernel is not None else 2 * bs), self.page_table.device)
        host = host_tensor.numpy()
        indptr = host[: bs + 1]
        indptr[0] = 0
        total = write_page_list_arrays(device_lens_cpu.numpy(), size, indptr[1:], host[bs + 1 : 2 * bs + 1])
        # torch slices (not numpy views) of the pinned buffer: plan() copies them to the device,
        # and only a slice of the allocator's own tensor keeps the block alive until that copy ran
        indptr_cpu, last_page_len_cpu = host_tensor[: bs + 1], host_tensor[bs + 1 : 2 * bs + 1]
        if self._kernel is not None:
            if device_lens is None:
                device_lens = device_lens_cpu.to(self.page_table.device, non_blocking=True)
            return PagedIndices(indptr_cpu, last_page_len_cpu, self._kernel(table_rows, device_lens, total), size)
        np.subtract(indptr[1:], indptr[:-1], out=host[2 * bs + 1 : 3 * bs + 1])  # pages per request
        # table index of request i's page j is row_i * width + S * (global page - indptr_i)
        host[3 * bs + 1 :] = -size * indptr[:-1]
        on_device = host_tensor[2 * bs + 1 :].to(self.page_table.device, non_blocking=True)
        base = torch.add(on_device[bs:], table_rows, alpha=self.page_table.shape[1])
        table_index = torch.repeat_interleave(base, on_device[:bs], output_size=total)
        table_index += self._page_offsets(total)
        indices = self._flat_table.index_select(0, table_index)
        if size > 1:
            indices = indices.div_(size, rounding_mode="floor")
        return PagedIndices(indptr_cpu, last_page_len_cpu, indices, size)
