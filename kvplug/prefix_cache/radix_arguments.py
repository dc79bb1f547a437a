"""Argument checks of the ``radix`` cache: a fast path for good input, the shared validators'
messages (``validation``) for bad input. Every check runs before the tree is touched."""

from __future__ import annotations

import operator
from typing import NoReturn

import torch

from kvplug.interface import InvalidArgumentError
from kvplug.prefix_cache.validation import check_insert_arguments, check_token_ids


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
        check_insert_arguments(input_ids, indices, device, page_size)
    layouts = [tensor.layout for tensor in (input_ids, indices) if tensor is not None]
    raise InvalidArgumentError(f"expected dense (torch.strided) tensors, got layouts {layouts}")


def checked_evict_size(size: object, evictable: int, protected: int) -> int:
    """``size`` as an int in ``[0, evictable]``, else ``InvalidArgumentError``."""
    try:
        if isinstance(size, bool):
            raise TypeError
        size = operator.index(size)
    except TypeError:
        raise InvalidArgumentError(f"evict size must be an int, got {size!r}") from None
    if size < 0:
        raise InvalidArgumentError(f"evict size must be >= 0, got {size}")
    if size > evictable:
        raise InvalidArgumentError(
            f"cannot evict {size} tokens: only {evictable} are evictable ({protected} more are locked)"
        )
    return size
