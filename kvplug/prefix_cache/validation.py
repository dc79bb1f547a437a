"""Argument checks shared by the built-in prefix caches (docs/design.md, section 8: clear errors,
nothing changed).

``naive`` and ``radix`` validate ``match_prefix``, ``insert_prefix``, ``lock_handle`` and ``evict``
through these functions, so the same bad argument gets the same ``InvalidArgumentError`` (and the
same message) from either. ``radix`` runs a cheap type filter first and calls them only when the
filter fails or to check values the filter cannot see: the locations of the part an insert adds
(never the already-cached prefix: validation costs O(new pages), not O(prompt)).
"""

from __future__ import annotations

import operator
from typing import NoReturn

import numpy as np
import torch

from kvplug.interface import InvalidArgumentError
from kvplug.tensor_checks import check_int32_vector


def check_token_ids(input_ids: torch.Tensor, device: torch.device, name: str = "input_ids") -> None:
    """``input_ids`` must be shape ``[n]``, int32, on ``device``."""
    check_int32_vector(input_ids, device, name)


def check_insert_arguments(
    input_ids: torch.Tensor, indices: torch.Tensor, device: torch.device, page_size: int
) -> None:
    """Both 1-D int32 on ``device``, of equal length, a multiple of ``page_size``; ``indices``
    distinct non-negative locations."""
    check_insert_shapes(input_ids, indices, device, page_size)
    check_location_values(indices.detach().cpu().numpy())


def check_insert_shapes(input_ids: torch.Tensor, indices: torch.Tensor, device: torch.device, page_size: int) -> None:
    """The shape, dtype, device and length rules of ``check_insert_arguments`` (not the values)."""
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


def check_location_values(locations: np.ndarray) -> None:
    """The locations of one ``insert_prefix`` (shape ``[n]``, int32, host) must be non-negative and
    distinct: a location names one token's slot in the KV pool, and a cache that kept a negative or
    a repeated one would hand it to the allocator (twice) on eviction."""
    if locations.size == 0:
        return
    if locations[0] >= 0 and b"\x00" not in np.greater(locations[1:], locations[:-1]).tobytes():
        return  # strictly increasing from a non-negative start (the allocator's usual runs): no sort
        # (a memchr over the comparison's bytes: numpy's all() costs more than the comparison)
    ordered = np.sort(locations)
    if ordered[0] < 0:
        position = int(np.flatnonzero(locations < 0)[0])
        raise InvalidArgumentError(
            f"indices must be non-negative KV-pool locations, got {int(locations[position])} at position {position}"
        )
    repeated = ordered[1:] == ordered[:-1]
    if repeated.any():
        value = int(ordered[1:][repeated][0])
        positions = np.flatnonzero(locations == value)[:2].tolist()
        raise InvalidArgumentError(
            f"indices must be distinct KV-pool locations, got {value} at positions {positions[0]} and {positions[1]}"
        )


def checked_evict_request(size: object) -> int:
    """``size`` as a non-negative int, else ``InvalidArgumentError``: an ``int`` or anything with
    ``__index__`` (a numpy integer); not a bool, float or string."""
    try:
        if isinstance(size, bool):
            raise TypeError
        size = operator.index(size)
    except TypeError:
        raise InvalidArgumentError(f"evict size must be an int, got {size!r}") from None
    if size < 0:
        raise InvalidArgumentError(f"evict size must be >= 0, got {size}")
    return size


def checked_evict_size(size: object, evictable: int, protected: int) -> int:
    """``size`` as an int in ``[0, evictable]``, else ``InvalidArgumentError`` (``checked_evict_request``
    first)."""
    size = checked_evict_request(size)
    if size > evictable:
        raise InvalidArgumentError(
            f"cannot evict {size} tokens: only {evictable} are evictable ({protected} more are locked)"
        )
    return size


def reject_unlock_flag(unlock: object) -> NoReturn:
    """``lock_handle``'s ``unlock`` must be a bool (``True`` or ``False``)."""
    raise InvalidArgumentError(f"unlock must be a bool, got {unlock!r}")


def reject_foreign_handle(cache_name: str, handle: object) -> NoReturn:
    """``lock_handle`` got a handle this cache did not issue."""
    raise InvalidArgumentError(f"expected a handle from this {cache_name} cache, got {handle!r}")
