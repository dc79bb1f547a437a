"""Store keys: 128-bit hashes chained from a prompt's pages, seeded by the KV namespace.

A key names the whole prefix ending with its page *and* the shape of the bytes behind it: the
chain starts from the namespace's digest (model, KV layout, page size, dtype, tensor-parallel
rank and size), so two servers that differ in any of them never share a key, and a mismatch is a
miss rather than wrong K/V. 128 bits, not the 64 of the KV events' page hashes: a collision in
a fleet-wide store would load another prompt's K/V silently.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvplug.interface.errors import InvalidArgumentError

KEY_VERSION = 1


@dataclass(frozen=True)
class KVNamespace:
    """What must match for a stored page to be loadable.

    Attributes:
        model: the model's identity (a path, hub id or checkpoint digest).
        layout: the byte layout of one page's value (e.g. ``"mha:L28:H8:D128:kv"``).
        page_size: tokens per page.
        dtype: the KV dtype (``"bfloat16"``).
        tp_rank, tp_size: this process's tensor-parallel rank and the group's size (each rank
            stores its own heads).
    """

    model: str
    layout: str
    page_size: int
    dtype: str
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("model", "layout", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidArgumentError(f"KVNamespace.{name} must be a non-empty str, got {value!r}")
        for name, low in (("page_size", 1), ("tp_size", 1), ("tp_rank", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"KVNamespace.{name} must be an int >= {low}, got {value!r}")
        if self.tp_rank >= self.tp_size:
            raise InvalidArgumentError(f"tp_rank must be < tp_size, got rank {self.tp_rank} of {self.tp_size}")

    @property
    def digest(self) -> bytes:
        fields = (KEY_VERSION, self.model, self.layout, self.page_size, self.dtype, self.tp_rank, self.tp_size)
        return hashlib.blake2b(repr(fields).encode(), digest_size=16).digest()

    @property
    def prefix(self) -> str:
        """Every key of this namespace starts with it (``kvplug:1:<32 hex digits>:``)."""
        return f"kvplug:{KEY_VERSION}:{self.digest.hex()}:"


def page_keys(namespace: KVNamespace, token_ids: Sequence[int]) -> tuple[str, ...]:
    """Keys of the whole pages of ``token_ids`` (a trailing partial page has none)."""
    ids = np.asarray(token_ids, dtype="<i4")
    if ids.ndim != 1:
        raise InvalidArgumentError(f"token_ids must be 1-D, got shape {tuple(ids.shape)}")
    page_size = namespace.page_size
    data = ids[: len(ids) - len(ids) % page_size].tobytes()
    step = page_size * 4
    prefix, parent = namespace.prefix, namespace.digest
    keys = []
    for start in range(0, len(data), step):
        parent = hashlib.blake2b(parent + data[start : start + step], digest_size=16).digest()
        keys.append(prefix + parent.hex())
    return tuple(keys)
