"""How the ``radix`` cache reads its tensor arguments: validated, then as host ``bytes`` / numpy.

Why two paths: the common argument, a dense 1-D int32 CPU tensor, is read in place through
``tensor.numpy()`` after a few attribute tests; anything else is validated with the shared
validators' messages (``validation``) and copied to a dense host tensor (a device tensor is copied
to the host, which synchronises with it). Both paths first check that the tensor's storage still
holds its view (``untyped_storage().resize_(0)`` frees it under a live tensor, and ``numpy()``
would then read freed memory). Every check runs before the tree is touched.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np
import torch

from kvplug.interface import InvalidArgumentError
from kvplug.prefix_cache.validation import check_insert_shapes, check_token_ids

_TENSOR = torch.Tensor  # module constants: one global load each on the hot path
_INT32 = torch.int32
_UNIT_STRIDE = (1,)


def dense_host_array(tensor: object) -> np.ndarray | None:
    """``tensor`` as an int32 numpy view when it is a plain ``torch.Tensor`` of shape ``[n]``, int32,
    on the CPU, with unit stride and its storage holding the view; else ``None``.

    A cheap filter, not a validator: ``None`` means "take the general path", which validates and
    explains (subclasses, other dtypes/devices/strides/layouts, freed storage, ...).
    """
    try:
        if (
            type(tensor) is _TENSOR
            and tensor.dtype is _INT32
            and tensor.is_cpu
            and tensor.stride() == _UNIT_STRIDE
            and (tensor.storage_offset() << 2) + tensor.nbytes <= tensor.untyped_storage().nbytes()
        ):
            return tensor.numpy()
    except RuntimeError:  # nested and compressed layouts have no strides (sparse COO reports 0)
        pass
    return None


def dense_host_pair(tokens: object, locations: object) -> tuple[np.ndarray, np.ndarray] | None:
    """``dense_host_array`` of both of an insert's tensors when both pass and their lengths agree,
    else ``None`` (one call: an insert's per-call cost is mostly these attribute reads)."""
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
            and (tokens.storage_offset() << 2) + nbytes <= tokens.untyped_storage().nbytes()
            and (locations.storage_offset() << 2) + nbytes <= locations.untyped_storage().nbytes()
        ):
            return tokens.numpy(), locations.numpy()
    except RuntimeError:  # nested and compressed layouts have no strides (sparse COO reports 0)
        pass
    return None


def check_storage(tensor: torch.Tensor, name: str) -> None:
    """Raise unless the storage of ``tensor`` (strided, validated) holds every element of its view."""
    if tensor.numel() == 0:
        return
    last = tensor.storage_offset() + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    needed = (last + 1) * tensor.element_size()
    held = tensor.untyped_storage().nbytes()
    if needed > held:
        raise InvalidArgumentError(
            f"{name}'s storage holds {held} bytes, its view of {tensor.numel()} elements needs {needed} "
            "(was the storage freed or resized?)"
        )


def host_array(tensor: torch.Tensor, stop: int, name: str) -> np.ndarray:
    """Elements ``[0, stop)`` of validated ``tensor`` (shape ``[n]``, int32, strided, any device) as a
    dense int32 numpy array on the host (a copy unless it already was one)."""
    check_storage(tensor, name)
    return tensor[:stop].detach().cpu().contiguous().numpy()


def is_valid_tensor(tensor: object, device: torch.device, on_cpu: bool) -> bool:
    """Shape ``[n]``, int32, dense, on ``device``; no error raised."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.dtype is torch.int32
        and tensor.ndim == 1
        and tensor.layout is torch.strided
        and (tensor.is_cpu if on_cpu else tensor.device == device)
    )


def reject(device: torch.device, page_size: int, input_ids: object, indices: object = None) -> NoReturn:
    """Raise the shared validators' error for arguments that failed the fast path."""
    if indices is None:
        check_token_ids(input_ids, device)
    else:
        check_insert_shapes(input_ids, indices, device, page_size)
    layouts = [tensor.layout for tensor in (input_ids, indices) if tensor is not None]
    raise InvalidArgumentError(f"expected dense (torch.strided) tensors, got layouts {layouts}")


def match_tokens(input_ids: object, device: torch.device, page_size: int) -> bytes:
    """``match_prefix``'s ids, validated (raising), their whole pages as int32 bytes."""
    ids = dense_host_array(input_ids) if device.type == "cpu" else None
    if ids is None:
        if not is_valid_tensor(input_ids, device, device.type == "cpu"):
            reject(device, page_size, input_ids)
        ids = host_array(input_ids, input_ids.shape[0], "input_ids")
    usable = ids.shape[0] - ids.shape[0] % page_size
    return (ids if usable == ids.shape[0] else ids[:usable]).tobytes()


def insert_arguments(
    input_ids: object, indices: object, device: torch.device, page_size: int
) -> tuple[bytes, np.ndarray]:
    """``insert_prefix``'s arguments with their shapes validated (raising): the ids as int32 bytes
    and the locations as an int32 numpy array of the same length, on the host. The location values
    are not checked here: the cache checks only the part it will keep (``validation``). The
    general path: the cache reads dense CPU tensors itself (``dense_host_array``)."""
    on_cpu = device.type == "cpu"
    valid = is_valid_tensor(input_ids, device, on_cpu) and is_valid_tensor(indices, device, on_cpu)
    length = input_ids.shape[0] if valid else -1
    if not valid or indices.shape[0] != length or length % page_size:
        reject(device, page_size, input_ids, indices)
    return host_array(input_ids, length, "input_ids").tobytes(), host_array(indices, length, "indices")


def location_array(locations: object, devices: tuple[torch.device, ...], length: int, name: str) -> np.ndarray:
    """Validated ``locations`` (shape ``[length]``, int32, on one of ``devices``) as a host int32
    numpy array; a device tensor is copied to the host (which synchronises with it)."""
    if not isinstance(locations, torch.Tensor) or locations.ndim != 1 or locations.dtype is not torch.int32 \
            or locations.layout is not torch.strided or locations.device not in devices:
        given = (
            f"{type(locations).__name__} of shape {tuple(locations.shape)}, {locations.dtype}, on {locations.device}"
            if isinstance(locations, torch.Tensor)
            else type(locations).__name__
        )
        raise InvalidArgumentError(
            f"{name} must be a dense 1-D int32 tensor on {' or '.join(str(d) for d in devices)}, got {given}"
        )
    if locations.shape[0] != length:
        raise InvalidArgumentError(f"{name} must hold {length} locations, got {locations.shape[0]}")
    return host_array(locations, length, name)
