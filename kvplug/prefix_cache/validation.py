"""Argument checks shared by the built-in prefix caches (SPEC §6: clear errors, nothing changed)."""

from __future__ import annotations

import torch

from kvplug.interface import InvalidArgumentError
from kvplug.tensor_checks import check_int32_vector


def check_token_ids(input_ids: torch.Tensor, device: torch.device, name: str = "input_ids") -> None:
    """``input_ids`` must be shape ``[n]``, int32, on ``device``."""
    check_int32_vector(input_ids, device, name)


def check_insert_arguments(
    input_ids: torch.Tensor, indices: torch.Tensor, device: torch.device, page_size: int
) -> None:
    """Both 1-D int32 on ``device``, of equal length, a multiple of ``page_size``."""
    check_token_ids(input_ids, device)
    check_token_ids(indices, device, name="indices")
    if input_ids.shape[0] != indices.shape[0]:
        raise InvalidArgumentError(
            f"input_ids and indices must have the same length, got {input_ids.shape[0]} and {indices.shape[0]}"
        )
    if input_ids.shape[0] % page_size:
        raise InvalidArgumentError(
            f"inserted length must be a multiple of the page size {page_size}, got {input_ids.shape[0]}"
        )

