"""Which decode batch sizes to capture, and how a smaller batch is padded to a captured one.

Padding uses the dummy request: the page table's last row, whose every entry is the first
location of the dummy page. A padded slot has ``cached_len = 0`` and ``device_len = 1``, so it
writes its K/V to the dummy page and attends over that one location, touching nothing a live
request owns.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from kvplug.interface import InvalidArgumentError


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to ``max_batch_size`` (which is always included)."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise InvalidArgumentError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
    sizes = {bs for bs in (1, 2, 4) if bs <= max_batch_size}
    sizes.update(range(8, max_batch_size + 1, 8))
    sizes.add(max_batch_size)
    return sorted(sizes)


def padded_size(batch_size: int, captured: Sequence[int]) -> int:
    """The smallest captured size >= ``batch_size`` (``captured`` sorted ascending)."""
    if not captured:
        raise InvalidArgumentError("no CUDA graph is captured (call capture() first, or after teardown())")
    position = bisect.bisect_left(captured, batch_size)
    if batch_size < 1 or position == len(captured):
        raise InvalidArgumentError(
            f"decode batch size {batch_size} is outside the captured sizes 1..{captured[-1]}; run it eagerly"
        )
    return captured[position]


def decode_input_layout(batch_size: int) -> tuple[int, ...]:
    """Sizes of the packed int32 decode inputs: rows | cached | device | extend_start | positions |
    table index (the page-table entry that is each request's ``out_loc``)."""
    return (batch_size, batch_size, batch_size, batch_size + 1, batch_size, batch_size)


def padded_decode_inputs(
    rows: np.ndarray, cached: np.ndarray, padded_bs: int, dummy_row: int, row_width: int
) -> np.ndarray:
    """Packed int32 inputs (``decode_input_layout(padded_bs)``) for live requests ``rows`` with
    ``cached`` tokens each, followed by ``padded_bs - len(rows)`` dummy requests.

    Args:
        rows: shape ``[bs]``, int, host; table rows of the live requests.
        cached: shape ``[bs]``, int, host; their cached lengths (each decodes one token).
    """
    bs = rows.shape[0]
    if bs > padded_bs:
        raise InvalidArgumentError(f"cannot pad {bs} requests down to {padded_bs}")
    packed = np.empty(6 * padded_bs + 1, dtype=np.int32)
    table_rows, cached_lens, device_lens, extend_start, positions, table_index = np.split(
        packed, np.cumsum(decode_input_layout(padded_bs))[:-1]
    )
    table_rows[:bs], table_rows[bs:] = rows, dummy_row
    cached_lens[:bs], cached_lens[bs:] = cached, 0
    device_lens[:] = cached_lens + 1
    extend_start[:] = np.arange(padded_bs + 1)
    positions[:] = cached_lens
    table_index[:] = table_rows.astype(np.int64) * row_width + cached_lens
    return packed
