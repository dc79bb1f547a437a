"""How the ``radix`` cache holds token ids and locations on the host: int32 as python ``bytes``.

``bytes`` make the hot path cheap: the first page of an edge is a hashable dict key, a whole edge
compares with one C-level ``bytes.startswith`` (a memcmp), joining a path's locations is one
``bytes.join``, and one copy brings a tensor's tokens to the host. numpy is used only to locate a
mismatch inside an edge. The layout is the platform's native int32, 4 bytes per token.
"""

from __future__ import annotations

from ctypes import string_at
from typing import Iterable

import numpy as np
import torch

BYTES_PER_TOKEN = 4


def tensor_bytes(tensor: torch.Tensor, start: int, stop: int) -> bytes:
    """Tokens ``[start, stop)`` of ``tensor`` as bytes, in one copy.

    Args:
        tensor: shape ``[n]``, int32, any device (already validated); a device tensor is copied
            to the host first, which synchronises with the device.
        start, stop: ``0 <= start <= stop <= n``.
    """
    if stop <= start:
        return b""
    if not tensor.is_cpu or not tensor.is_contiguous():
        tensor, start, stop = tensor[start:stop].cpu().contiguous(), 0, stop - start
    return string_at(tensor.data_ptr() + start * BYTES_PER_TOKEN, (stop - start) * BYTES_PER_TOKEN)


def locations_tensor(parts: Iterable[bytes], device: torch.device) -> torch.Tensor:
    """Concatenated locations: shape ``[sum of parts]``, int32, on ``device``; a fresh tensor.

    ``parts`` must hold at least one byte in total (``torch.frombuffer`` rejects empty buffers).
    """
    tensor = torch.frombuffer(bytearray().join(parts), dtype=torch.int32)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=False)


def as_int32(data: bytes) -> np.ndarray:
    """A read-only int32 view of ``data`` (for checks and debugging)."""
    return np.frombuffer(data, dtype=np.int32)


def shared_page_bytes(key: bytes, ids: bytes, position: int, page_size: int) -> int:
    """Bytes of the whole pages that ``key`` shares with ``ids[position:]``.

    One vectorised comparison finds the first differing token; the result is rounded down to a
    page boundary, since only whole pages are cached.
    """
    count = min(len(key), len(ids) - position) // BYTES_PER_TOKEN
    ours = np.frombuffer(key, dtype=np.int32, count=count)
    theirs = np.frombuffer(ids, dtype=np.int32, count=count, offset=position)
    differs = ours != theirs
    first_mismatch = int(differs.argmax()) if differs.any() else count
    return first_mismatch // page_size * page_size * BYTES_PER_TOKEN
