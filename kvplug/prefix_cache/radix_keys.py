"""How the ``radix`` cache holds token ids and locations on the host: int32 as python ``bytes``.

``bytes`` make the hot path cheap: the first page of an edge is a hashable dict key, a whole edge
compares with one C-level ``bytes.startswith`` (a memcmp), joining a path's locations is one
``bytes.join``, and one copy brings a tensor's tokens to the host. numpy is used only to locate a
mismatch inside an edge. The layout is the platform's native int32, 4 bytes per token.

Copying a host tensor's memory into ``bytes`` is the per-call cost that matters most (a few
hundred ns against a tree walk of about a microsecond), so the common case, a dense 1-D int32
CPU tensor, is read in place through ``ADDRESS_SPACE``/``ADDRESS_VIEW`` (``dense_host_nbytes`` says
when it may).
Everything else goes through ``tensor_bytes``, which handles any device and any strides.
"""

from __future__ import annotations

import sys
from ctypes import c_char
from typing import Iterable

import numpy as np
import torch

BYTES_PER_TOKEN = 4

# The process's memory as one char array, and a read-only byte view of it. ``ADDRESS_SPACE[p : p + n]``
# is one C-level copy of the n bytes at address p into a new ``bytes`` (~0.1-0.2 us, against
# ~0.55 us for ``ctypes.string_at``'s foreign call); ``ADDRESS_VIEW[p : p + n]`` is the same bytes
# without a copy, which ``bytes.startswith`` compares with one memcmp. The radix cache reads token
# ids in place through these instead of copying a whole prompt per call (allocating and freeing a
# 10 KB buffer per call cost more than the tree walk). Only ever sliced over the data of a live
# tensor that ``dense_host_nbytes`` accepted (or a dense host copy), so nothing else is read.
if sys.maxsize < 2**62:  # a shorter array would silently clamp slices past its end
    raise ImportError("kvplug's radix prefix cache needs a 64-bit Python")
ADDRESS_SPACE = (c_char * sys.maxsize).from_address(0)
ADDRESS_VIEW = memoryview(ADDRESS_SPACE).cast("B").toreadonly()
_UNIT_STRIDE = (1,)
_TENSOR = torch.Tensor  # module constants: one global load each on the hot path
_INT32 = torch.int32


def dense_host_nbytes(tensor: object) -> int:
    """``tensor.nbytes`` for a plain ``torch.Tensor`` of shape ``[n]``, int32, on the CPU, with unit
    stride, else -1.

    Its bytes are then ``ADDRESS_SPACE[p : p + nbytes]`` with ``p = tensor.data_ptr()``. A cheap
    filter, not a validator: -1 (subclasses, other dtypes/devices/strides/layouts, size-1 views with
    odd strides, ...) means "take the general path", which validates and explains.
    """
    try:
        if (
            type(tensor) is _TENSOR
            and tensor.dtype is _INT32
            and tensor.is_cpu
            and tensor.stride() == _UNIT_STRIDE
        ):
            return tensor.nbytes
    except RuntimeError:  # nested and compressed layouts have no strides (sparse COO reports 0)
        pass
    return -1


def dense_host_pair_nbytes(tokens: object, locations: object) -> int:
    """``dense_host_nbytes`` of both tensors when they agree and are not -1, else -1 (one call for
    the two arguments of an insert, whose per-call cost is mostly these attribute reads)."""
    try:
        if (
            type(tokens) is _TENSOR
            and type(locations) is _TENSOR
            and tokens.dtype is _INT32
            and locations.dtype is _INT32
            and tokens.is_cpu
            and locations.is_cpu
            and tokens.stride() == _UNIT_STRIDE
            and locations.stride() == _UNIT_STRIDE
            and (nbytes := tokens.nbytes) == locations.nbytes
        ):
            return nbytes
    except RuntimeError:  # nested and compressed layouts have no strides (sparse COO reports 0)
        pass
    return -1


def tensor_bytes(tensor: torch.Tensor, start: int, stop: int) -> bytes:
    """Tokens ``[start, stop)`` of ``tensor`` as bytes, in one copy (the general path).

    Args:
        tensor: shape ``[n]``, int32, strided, any device (already validated); a device tensor is
            copied to the host first, which synchronises with the device.
        start, stop: ``0 <= start <= stop <= n``.
    """
    if stop <= start:
        return b""
    if not tensor.is_cpu or not tensor.is_contiguous():
        tensor, start, stop = tensor[start:stop].cpu().contiguous(), 0, stop - start
    address = tensor.data_ptr()
    return ADDRESS_SPACE[address + start * BYTES_PER_TOKEN : address + stop * BYTES_PER_TOKEN]


def dense_host_tokens(tensor: torch.Tensor, stop: int) -> torch.Tensor:
    """Tokens ``[0, stop)`` of ``tensor`` as a dense host tensor (the general path's input copy).

    Args:
        tensor: shape ``[n]``, int32, strided, any device (already validated); returned as is when
            it is already dense on the host, else copied (synchronising with its device).
        stop: ``0 <= stop <= n``.

    Returns:
        shape ``[stop]``, int32, cpu, contiguous; its memory may be read through ``ADDRESS_SPACE``
        while the caller holds it.
    """
    return tensor[:stop].cpu().contiguous()


def locations_tensor(parts: Iterable[bytes], device: torch.device) -> torch.Tensor:
    """Concatenated locations: shape ``[sum of parts]``, int32, on ``device``; a fresh tensor.

    ``parts`` must hold at least one byte in total (``torch.frombuffer`` rejects empty buffers).
    """
    tensor = torch.frombuffer(bytearray().join(parts), dtype=torch.int32)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=False)


def as_int32(data: bytes) -> np.ndarray:
    """A read-only int32 view of ``data`` (for checks and debugging)."""
    return np.frombuffer(data, dtype=np.int32)


def shared_page_bytes(key: bytes, ids: memoryview | bytes, page_size: int) -> int:
    """Bytes of the whole pages at the start of ``key`` that ``ids`` starts with as well.

    One vectorised comparison finds the first differing token; the result is rounded down to a
    page boundary, since only whole pages are cached. ``ids`` may be shorter or longer than ``key``.
    """
    count = min(len(key), len(ids)) // BYTES_PER_TOKEN
    ours = np.frombuffer(key, dtype=np.int32, count=count)
    theirs = np.frombuffer(ids, dtype=np.int32, count=count)
    differs = ours != theirs
    first_mismatch = int(differs.argmax()) if differs.any() else count
    return first_mismatch // page_size * page_size * BYTES_PER_TOKEN
