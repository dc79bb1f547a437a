"""How much KV cache a memory budget buys: bytes per token, pages, tokens, concurrent requests.

The budget is per rank: with tensor parallelism each rank stores only its KV heads, so one
token costs ``2 * layers * local_kv_heads * head_dim * element_size`` bytes there. The pool
reserves one extra page (the dummy page) out of the budget.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from typing import TYPE_CHECKING

from kvplug.interface import InvalidArgumentError

if TYPE_CHECKING:  # torch-free at run time: kvplug capacity answers without importing torch
    from kvplug.memory.model_config import KVGeometry
    from kvplug.memory.model_shape import ModelShape

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory_size(value: str | int) -> int:
    """Bytes from an int or a string: ``"40GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1000000"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) of 1000.
    """
    if isinstance(value, bool):
        raise InvalidArgumentError(f"memory size must be bytes or a string like '40GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_PATTERN.match(value) if isinstance(value, str) else None
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidArgumentError(
                f"memory size must be bytes or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
                f"like '40GiB' or '512MiB'; got {value!r}"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise InvalidArgumentError(f"memory size must be positive, got {value!r}")
    return size


def num_pages_for_budget(bytes_per_token: int, page_size: int, memory_budget: int) -> int:
    """Pages that fit in ``memory_budget`` bytes after reserving the dummy page.

    Raises ``InvalidArgumentError`` when the budget cannot hold one page plus the dummy page.
    """
    page_bytes = bytes_per_token * page_size
    num_pages = memory_budget // page_bytes - 1
    if num_pages < 1:
        raise InvalidArgumentError(
            f"a memory budget of {memory_budget} bytes cannot hold 2 pages (one usable + the dummy page) of "
            f"{page_size} tokens x {bytes_per_token} bytes = {2 * page_bytes} bytes"
        )
    return num_pages


@dataclass(frozen=True)
class CapacityPlan:
    """What a memory budget holds, on one rank.

    Attributes:
        bytes_per_token: K+V bytes of one token over all layers on this rank.
        page_size: tokens per page.
        num_pages: usable pages (dummy page excluded).
        num_tokens: usable token locations, ``num_pages * page_size``.
        pool_bytes: bytes of the whole pool, dummy page included.
        memory_budget: the budget given, in bytes.
        context_len: the request length asked about (``None`` if not given).
        concurrent_requests: requests of ``context_len`` tokens that fit at once (``None`` if
            no length was given); each occupies ``ceil(context_len / page_size)`` pages.
        host_memory: the host-memory tier's budget in bytes (``None`` without a tier).
        host_pages, host_tokens: pages (each all layers of one device page) and tokens the host
            tier holds, as the ``radix`` cache with ``host_memory`` sizes it (0 without a tier).
        cached_tokens: tokens the prefix cache can keep over both tiers, ``num_tokens + host_tokens``.
    """

    bytes_per_token: int
    page_size: int
    num_pages: int
    num_tokens: int
    pool_bytes: int
    memory_budget: int
    context_len: int | None
    concurrent_requests: int | None
    host_memory: int | None = None
    host_pages: int = 0
    host_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        return self.num_tokens + self.host_tokens

    def to_json(self) -> dict:
        return {**asdict(self), "cached_tokens": self.cached_tokens}


def plan_capacity(
    shape: "ModelShape | KVGeometry",
    memory_budget: int | str,
    *,
    page_size: int = 1,
    tp_size: int = 1,
    context_len: int | None = None,
    host_memory: int | str | None = None,
) -> CapacityPlan:
    """Size a KV pool for ``shape`` (its ``dtype`` is the KV dtype; a ``ModelShape`` or a torch-free
    ``KVGeometry``) within ``memory_budget`` bytes per rank, and, with ``host_memory``, the
    host-memory tier under it (``host_memory // page bytes`` pages, as the tiered cache sizes it)."""
    for name, value in (("page_size", page_size), ("tp_size", tp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    if context_len is not None and (isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 1):
        raise InvalidArgumentError(f"context_len must be a positive int, got {context_len!r}")
    budget = parse_memory_size(memory_budget)
    bytes_per_token = shape.kv_bytes_per_token(tp_size)
    num_pages = num_pages_for_budget(bytes_per_token, page_size, budget)
    host_budget = host_pages = None
    if host_memory is not None:
        host_budget = parse_memory_size(host_memory)
        host_pages = host_budget // (bytes_per_token * page_size)
    concurrent = None
    if context_len is not None:
        concurrent = num_pages // -(-context_len // page_size)
    return CapacityPlan(
        bytes_per_token=bytes_per_token,
        page_size=page_size,
        num_pages=num_pages,
        num_tokens=num_pages * page_size,
        pool_bytes=(num_pages + 1) * page_size * bytes_per_token,
        memory_budget=budget,
        context_len=context_len,
        concurrent_requests=concurrent,
        host_memory=host_budget,
        host_pages=host_pages or 0,
        host_tokens=(host_pages or 0) * page_size,
    )
