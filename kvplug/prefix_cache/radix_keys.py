"""How the ``radix`` cache holds token ids and locations on the host: int32 as python ``bytes``.

Why ``bytes``: the first page of an edge is a hashable dict key, a whole edge compares with one
C-level ``bytes.startswith`` (a memcmp, no slice copied), and joining a path's locations is one
``bytes.join``. Tensors become ``bytes`` through numpy's buffer (``tensor.numpy()``): bounds-checked,
no raw address arithmetic. The layout is the platform's native int32, 4 bytes per token.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

BYTES_PER_TOKEN = 4


def locations_tensor(parts: Iterable[bytes], device: torch.device) -> torch.Tensor:
    """Concatenated locations: shape ``[sum of parts]``, int32, on ``device``; a fresh tensor.

    ``parts`` must hold at least one byte in total (``torch.frombuffer`` rejects empty buffers).
    """
    tensor = torch.frombuffer(bytearray().join(parts), dtype=torch.int32)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=False)


def as_int32(data: bytes) -> np.ndarray:
    """A read-only int32 view of ``data`` (for checks and debugging)."""
    return np.frombuffer(data, dtype=np.int32)


def shared_page_bytes(key: bytes, ids: bytes, offset: int, page_size: int) -> int:
    """Bytes of the whole pages at the start of ``key`` that ``ids[offset:]`` starts with as well.

    One vectorised comparison finds the first differing token; the result is rounded down to a
    page boundary, since only whole pages are cached. ``ids[offset:]`` may be shorter or longer
    than ``key``; ``offset`` is in bytes, a multiple of 4.
    """
    count = min(len(key), len(ids) - offset) // BYTES_PER_TOKEN
    ours = np.frombuffer(key, dtype=np.int32, count=count)
    theirs = np.frombuffer(ids, dtype=np.int32, count=count, offset=offset)
    differs = ours != theirs
    first_mismatch = int(differs.argmax()) if differs.any() else count
    return first_mismatch // page_size * page_size * BYTES_PER_TOKEN
