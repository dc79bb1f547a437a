"""Which decode batch sizes to capture, and which captured size a batch is padded to.

Padding uses the dummy request: the page table's last row, whose every entry is the first
location of the dummy page. A padded slot has ``cached_len = 0`` and ``device_len = 1``, so it
writes its K/V to the dummy page and attends over that one location, touching nothing a live
request owns (``DecodeStager.stage(..., pad_to=...)`` writes it).
"""

from __future__ import annotations

import bisect
from typing import Sequence

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
