"""The KV-pool contract: one preallocated tensor holding every layer's K and V (docs/design.md,
sections 1 and 4).

Layout of the built-in ``mha`` pool: ``[2, num_layers, num_pages + 1, page_size, local_kv_heads,
head_dim]``. Flattening axes 2 and 3 gives *token locations*: location ``j`` is row ``j`` of the
per-layer view ``[(num_pages + 1) * page_size, local_kv_heads, head_dim]``. The last page is the
dummy page: never handed out, written only by padded (dummy) requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from kvplug.interface.errors import InvalidArgumentError
from kvplug.interface.prefix_cache import _frozen_mapping

SUPPORTED_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class KVPoolConfig:
    """What a KV-pool factory receives.

    Attributes:
        num_layers: attention layers stored in the pool.
        num_kv_heads: the model's *global* KV-head count; the pool keeps its tensor-parallel share.
        head_dim: elements per head.
        num_pages: pages that can be handed out (the dummy page comes on top).
        page_size: tokens per page.
        dtype: element type of K and V.
        device: where the pool lives.
        tp_size, tp_rank: tensor-parallel world size and this rank.
        options: plugin-specific options.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int = 1
    dtype: torch.dtype = torch.bfloat16
    device: torch.device = torch.device("cpu")
    tp_size: int = 1
    tp_rank: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_pages", "page_size", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"KVPoolConfig.{name} must be a positive int, got {value!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgumentError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")
        if self.dtype not in SUPPORTED_KV_DTYPES:
            raise InvalidArgumentError(f"dtype must be one of {SUPPORTED_KV_DTYPES}, got {self.dtype}")
        object.__setattr__(self, "device", torch.device(self.device))
        object.__setattr__(self, "options", _frozen_mapping(self.options))


class BaseKVPool(ABC):
    """Abstract KV pool: per-layer K/V storage addressed by token location."""

    @abstractmethod
    def k_cache(self, layer_id: int) -> torch.Tensor:
        """K of one layer: shape ``[num_pages + 1, page_size, local_kv_heads, head_dim]``, pool dtype, pool device."""

    @abstractmethod
    def v_cache(self, layer_id: int) -> torch.Tensor:
        """V of one layer, same shape as ``k_cache``."""

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        """Write new K/V rows at token locations.

        Args:
            k, v: shape ``[n, local_kv_heads * head_dim]`` or ``[n, local_kv_heads, head_dim]``,
                pool dtype, pool device.
            out_loc: shape ``[n]``, int32, pool device; token locations in
                ``[0, (num_pages + 1) * page_size)``.
            layer_id: in ``[0, num_layers)``.
        """

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @property
    @abstractmethod
    def num_pages(self) -> int:
        """Pages that can be handed out; excludes the dummy page."""

    @property
    @abstractmethod
    def page_size(self) -> int: ...

    @property
    @abstractmethod
    def local_kv_heads(self) -> int: ...

    @property
    @abstractmethod
    def head_dim(self) -> int: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    def num_tokens(self) -> int:
        """Token locations that can be handed out: ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @property
    def dummy_location(self) -> int:
        """First token location of the dummy page (== ``num_tokens``)."""
        return self.num_pages * self.page_size
