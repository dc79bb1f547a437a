"""Token ids from a host, checked and converted to kvplug's form: 1-D int32 on the pool device."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvplug.interface import InvalidArgumentError

MAX_TOKEN_ID = 2**31 - 1


def as_token_ids(
    values: torch.Tensor | Sequence[int], device: torch.device, *, allow_empty: bool = False, check_values: bool = False
) -> torch.Tensor:
    """``values`` as shape ``[n]``, int32, on ``device``.

    Accepts a 1-D integer tensor on any device or a sequence of Python ints. Values must lie in
    ``[0, 2**31 - 1]``: checked for lists, CPU tensors and other integer dtypes (which reads
    them); an int32 tensor on a GPU is returned as is unless ``check_values`` (a device sync: for
    prompts at admission, not for sampled ids every step).
    """
    if isinstance(values, torch.Tensor):
        dtype = values.dtype
        if values.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise InvalidArgumentError(f"token ids must be a 1-D integer tensor, got shape {tuple(values.shape)}, {dtype}")
        if values.numel() and (dtype != torch.int32 or check_values or values.device.type == "cpu"):
            if not bool(((values >= 0) & (values <= MAX_TOKEN_ID)).all()):
                raise InvalidArgumentError(
                    f"token ids must lie in [0, {MAX_TOKEN_ID}], got values in [{int(values.min())}, {int(values.max())}]"
                )
        ids = values.to(device, torch.int32)
    else:
        # numpy converts the list in C: a Python check per token costs ~1 ms per 8k-token prompt.
        # Floats, strings, None or out-of-int64 values give a non-integer array; all-bool lists a
        # bool one (a bool mixed into ints reads as 0 / 1, as numpy and torch both read it)
        try:
            array = np.asarray(values)
        except (ValueError, TypeError, OverflowError):  # ragged nesting and the like
            array = None
        if array is None or array.ndim != 1 or (
            array.size and (array.dtype.kind not in "iu" or array.min() < 0 or array.max() > MAX_TOKEN_ID)
        ):
            raise InvalidArgumentError(f"token ids must be a flat list of ints in [0, {MAX_TOKEN_ID}], got {values!r:.120}")
        ids = torch.from_numpy(array.astype(np.int32)).to(device)
    if ids.shape[0] == 0 and not allow_empty:
        raise InvalidArgumentError("a request needs at least one token id, got none")
    return ids
