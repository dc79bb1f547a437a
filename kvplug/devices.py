"""Device names made comparable: ``cuda`` becomes ``cuda:<current>`` so that every component's
device checks agree with the tensors a host actually passes (which always carry an index)."""

from __future__ import annotations

import torch

from kvplug.interface.errors import InvalidArgumentError


def resolve_device(device: str | torch.device, *, require_available: bool = False) -> torch.device:
    """Parse ``device`` and give a bare ``cuda`` the current CUDA device's index.

    With ``require_available``, naming CUDA on a machine without it is an ``InvalidArgumentError``;
    without it, a bare ``cuda`` stays as it is there (configs can be built anywhere).
    """
    try:
        resolved = torch.device(device)
    except (TypeError, RuntimeError) as error:
        raise InvalidArgumentError(f"device must name a torch device, got {device!r}") from error
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            if require_available:
                raise InvalidArgumentError(f"device {resolved} requested but CUDA is not available")
            return resolved
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved
