"""Token ids from a host, checked and converted to kvplug's forms: prompts as 1-D int32 *host*
tensors (bookkeeping and the prefix cache read them), sampled ids as 1-D int32 device tensors."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvplug.interface import InvalidArgumentError

MAX_TOKEN_ID = 2**31 - 1


def host_token_ids(values: torch.Tensor | np.ndarray | Sequence[int], *, allow_empty: bool = False) -> torch.Tensor:
    """``values`` as shape ``[n]``, int32, cpu, checked to lie in ``[0, 2**31 - 1]``.

    Accepts a list of ints, a 1-D integer numpy array or tensor. A tensor on a GPU is copied to
    the host, which waits for the work queued before it: give prompts as host data.
    """
    if isinstance(values, torch.Tensor):
        dtype = values.dtype
        if values.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise InvalidArgumentError(f"token ids must be a 1-D integer tensor, got shape {tuple(values.shape)}, {dtype}")
        array = values.detach().cpu().numpy()
    else:
        # numpy converts the list in C: a Python check per token would cost more than the match.
        # Floats, strings, None or out-of-int64 values give a non-integer array; all-bool lists a
        # bool one (a bool mixed into ints reads as 0 / 1, as numpy and torch both read it)
        try:
            array = np.asarray(values)
        except (ValueError, TypeError, OverflowError):  # ragged nesting and the like
            array = None
        if array is None or array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"token ids must be a flat list of ints in [0, {MAX_TOKEN_ID}], got {values!r:.120}")
    if array.size and (array.min() < 0 or array.max() > MAX_TOKEN_ID):
        raise InvalidArgumentError(
            f"token ids must lie in [0, {MAX_TOKEN_ID}], got values in [{int(array.min())}, {int(array.max())}]"
        )
    if array.shape[0] == 0 and not allow_empty:
        raise InvalidArgumentError("a request needs at least one token id, got none")
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))


def as_token_ids(
    values: torch.Tensor | Sequence[int], device: torch.device, *, allow_empty: bool = False
) -> torch.Tensor:
    """``values`` as shape ``[n]``, int32, on ``device`` (sampled ids).

    Accepts a 1-D integer tensor on any device or a sequence of Python ints. Values must lie in
    ``[0, 2**31 - 1]``: checked for host values and other integer dtypes; an int32 tensor already
    on a GPU is not read (that would wait for the device).
    """
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        dtype = values.dtype
        if values.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise InvalidArgumentError(f"token ids must be a 1-D integer tensor, got shape {tuple(values.shape)}, {dtype}")
        if values.numel() and dtype != torch.int32:
            if not bool(((values >= 0) & (values <= MAX_TOKEN_ID)).all()):
                raise InvalidArgumentError(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
        ids = values.to(device, torch.int32)
        if ids.shape[0] == 0 and not allow_empty:
            raise InvalidArgumentError("a request needs at least one token id, got none")
        return ids
    ids = host_token_ids(values, allow_empty=allow_empty)
    if device.type == "cuda":  # from pinned memory: the upload does not wait for queued work
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)
