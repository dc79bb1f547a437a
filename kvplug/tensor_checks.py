"""The argument check every component shares: a 1-D int32 tensor on the component's device
(token ids, token locations, table values). One message format everywhere (docs/design.md, section 8)."""

from __future__ import annotations

import torch

from kvplug.interface.errors import InvalidArgumentError


def check_int32_vector(tensor: object, device: torch.device, name: str) -> None:
    """Raise ``InvalidArgumentError`` unless ``tensor`` is a torch.Tensor of shape ``[n]``, int32, on ``device``."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1:
        raise InvalidArgumentError(f"{name} must be 1-D (shape [n]), got shape {tuple(tensor.shape)}")
    if tensor.dtype != torch.int32:
        raise InvalidArgumentError(f"{name} must be int32, got {tensor.dtype}")
    if tensor.device != device:
        raise InvalidArgumentError(f"{name} must be on {device}, got {tensor.device}")
