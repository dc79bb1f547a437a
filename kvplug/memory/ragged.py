"""Flat indices for ragged per-request ranges, built with vector ops on the host.

A batch touches columns ``starts[i] .. starts[i] + lengths[i] - 1`` of table row ``rows[i]``.
Scattered reads and writes of the page table and token pool need those coordinates as flat
indices; building them with ``np.repeat`` keeps Python out of the per-token path (numpy, not
torch, because a dozen tiny host ops cost a few microseconds each in torch).
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch

from kvplug.interface import InvalidArgumentError

HostInts = Union[Sequence[int], np.ndarray, torch.Tensor]


def host_ints(values: HostInts, name: str) -> np.ndarray:
    """``values`` as a 1-D int64 numpy array (host side)."""
    if isinstance(values, np.ndarray):
        array = values
    elif isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise InvalidArgumentError(f"{name} must be host values (list, numpy or CPU tensor), got a tensor on {values.device}")
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise InvalidArgumentError(f"{name} must hold integers, got dtype {values.dtype}")
        array = values.numpy()
    else:
        array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{name} must hold integers, got {array.dtype} values")
    if array.ndim != 1:
        raise InvalidArgumentError(f"{name} must be 1-D, got shape {tuple(array.shape)}")
    return array.astype(np.int64, copy=False)


def ragged_coordinates(rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat coordinates of ragged ranges.

    Args:
        rows: shape ``[bs]``, int64, host.
        starts: shape ``[bs]``, int64, host; first column of each range.
        lengths: shape ``[bs]``, int64, host; non-negative.

    Returns:
        ``(row_index, column_index)``: each shape ``[sum(lengths)]``, int64, host, ranges in
        batch order.
    """
    total = int(lengths.sum())
    row_index = np.repeat(rows, lengths)
    # column = start of own range + offset inside it = flat position - where the range begins + start
    range_begin = np.cumsum(lengths) - lengths
    column_index = np.arange(total, dtype=np.int64) + np.repeat(starts - range_begin, lengths)
    return row_index, column_index


def expand_pages(page_starts: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token locations of whole pages.

    Args:
        page_starts: shape ``[num_pages]``, int32, any device; first location of each page.

    Returns:
        shape ``[num_pages * page_size]``, int32, same device; pages in order, each expanded to
        ``start, start + 1, ..., start + page_size - 1``.
    """
    if page_size == 1:
        return page_starts
    offsets = torch.arange(page_size, dtype=page_starts.dtype, device=page_starts.device)
    return (page_starts.unsqueeze(1) + offsets).reshape(-1)
