"""Argument checks of the ``radix`` cache's general path (anything but dense int32 CPU tensors, see
``radix_keys.dense_host_nbytes``): validate with the shared validators' messages (``validation``),
then bring the token ids to a dense host tensor. Every check runs before the tree is touched."""

from __future__ import annotations

from typing import NoReturn

import torch

from kvplug.interface import InvalidArgumentError
from kvplug.prefix_cache.radix_keys import dense_host_tokens
from kvplug.prefix_cache.validation import check_insert_shapes, check_location_values, check_token_ids


def is_valid_tensor(tensor: torch.Tensor, device: torch.device, on_cpu: bool) -> bool:
    """Shape ``[n]``, int32, dense (its memory is read directly), on ``device``; no error raised."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.dtype is torch.int32
        and tensor.ndim == 1
        and tensor.layout is torch.strided
        and (tensor.is_cpu if on_cpu else tensor.device == device)
    )


def reject(
    device: torch.device, page_size: int, input_ids: torch.Tensor, indices: torch.Tensor | None = None
) -> NoReturn:
    """Raise the shared validators' error for arguments that failed the fast path."""
    if indices is None:
        check_token_ids(input_ids, device)
    else:
        check_insert_shapes(input_ids, indices, device, page_size)
    layouts = [tensor.layout for tensor in (input_ids, indices) if tensor is not None]
    raise InvalidArgumentError(f"expected dense (torch.strided) tensors, got layouts {layouts}")


def checked_host_tokens(input_ids: torch.Tensor, device: torch.device, page_size: int) -> torch.Tensor:
    """``match_prefix``'s ids, validated (raising), as shape ``[n - n % page_size]``, int32, cpu, dense."""
    if not is_valid_tensor(input_ids, device, device.type == "cpu"):
        reject(device, page_size, input_ids)
    length = input_ids.numel()
    return dense_host_tokens(input_ids, length - length % page_size)


def checked_host_insert_tokens(
    input_ids: torch.Tensor, indices: torch.Tensor, device: torch.device, page_size: int
) -> torch.Tensor:
    """``insert_prefix``'s arguments validated (raising); returns the ids as shape ``[n]``, int32,
    cpu, dense (``indices`` is read later, only the part that gets cached; its values are checked here)."""
    on_cpu = device.type == "cpu"
    valid = is_valid_tensor(input_ids, device, on_cpu) and is_valid_tensor(indices, device, on_cpu)
    length = input_ids.numel() if valid else -1
    if not valid or indices.numel() != length or length % page_size:
        reject(device, page_size, input_ids, indices)
    check_location_values(indices.detach().cpu().numpy())
    return dense_host_tokens(input_ids, length)
