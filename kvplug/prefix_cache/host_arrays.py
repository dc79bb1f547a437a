"""``HostArrayCalls``: an internal capability of built-in prefix caches, called with host numpy arrays.

Why: kvplug's allocator keeps token ids and locations as int32 numpy arrays on the host (its page
table), and a built-in cache stores them as host bytes. Through the public contract each call would
wrap them in tensors that the cache unwraps and re-checks again; a cache with this capability takes
the arrays as they are, and returns a bare handle (``match_host``), a plain pair (``insert_host``)
and a host array (``evict_host``) instead of building result objects. The public tensor methods
(``kvplug.interface``) are unchanged and remain what third-party callers use.

Not part of the public contract: a plugin never implements it, and kvplug uses it only for a
cache that is an instance of this class (a wrapper such as ``CheckedPrefixCache`` is not).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NoReturn

import numpy as np

from kvplug.interface import BaseCacheHandle, InvalidArgumentError
from kvplug.prefix_cache.radix_arguments import dense_host_array

HOST_INT32 = np.dtype(np.int32)  # the native int32 descriptor that every int32 array shares


class HostArrayCalls(ABC):
    """``match_prefix`` / ``insert_prefix`` / ``evict`` over host arrays (see the module docstring).

    Arrays are shape ``[n]``, int32 (native byte order), any strides; they are read during the
    call and never kept, so the caller may reuse them at once. Shapes and dtypes are checked as in
    the tensor methods; the *values* of ``insert_host``'s locations are not: the caller hands over
    KV pages it owns (kvplug's allocator keeps one owner per page, ``check_allocator``), where
    ``insert_prefix`` checks a third party's (distinct, non-negative; the new part only).
    """

    @abstractmethod
    def match_host(self, input_ids: np.ndarray) -> BaseCacheHandle:
        """``match_prefix(input_ids).handle`` for a host array of token ids."""

    @abstractmethod
    def insert_host(self, input_ids: np.ndarray, indices: np.ndarray) -> tuple[int, BaseCacheHandle]:
        """``insert_prefix`` for host arrays of the caller's own pages (their location values
        unchecked); returns ``(cached_len, handle)`` (``InsertResult``'s fields)."""

    @abstractmethod
    def evict_host(self, size: int) -> np.ndarray:
        """``evict(size)`` as a read-only host int32 array of the freed locations."""


def host_view(tensor: object) -> np.ndarray | None:
    """``tensor`` as a numpy view for a ``HostArrayCalls`` call when it is a dense 1-D int32 CPU
    tensor whose storage holds it, else ``None`` (the caller then uses the tensor methods, which
    validate and explain)."""
    return dense_host_array(tensor)


def is_host_int32(array: object) -> bool:
    """``array`` is a numpy array of shape ``[n]`` and int32 values (whatever its descriptor object)."""
    return isinstance(array, np.ndarray) and array.ndim == 1 and array.dtype == HOST_INT32


def reject_host_array(array: object, name: str) -> NoReturn:
    """Raise for a host-array argument that is not a shape ``[n]`` int32 numpy array."""
    given = (
        f"an array of shape {array.shape}, {array.dtype}"
        if isinstance(array, np.ndarray)
        else type(array).__name__
    )
    raise InvalidArgumentError(f"{name} must be a numpy array of shape [n], int32, got {given}")
