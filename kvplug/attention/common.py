"""What every built-in backend shares: config checks, per-layer flat cache views, q/k/v shape
handling and the store-then-attend step."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from kvplug.interface import AttentionBatch, AttentionConfig, BaseAttentionBackend, InvalidArgumentError


def import_optional(module: str, *, extra: str, purpose: str) -> Any:
    """Import a GPU library lazily; a missing one is an ``ImportError`` naming the pip extra."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{purpose} needs the Python package {module!r}, which failed to import ({error}); "
            f"install it with `pip install -e \".[{extra}]\"` from the kvplug repository"
        ) from error


class PoolAttentionBackend(BaseAttentionBackend):
    """Base of the built-in backends: holds the pool, the page table and the head geometry.

    Subclasses implement ``prepare_metadata`` and ``_attend(q, layer_id, batch)``; ``forward``
    validates shapes, stores the new K/V through the pool, then attends.
    """

    #: ``"any"`` or a device type the backend requires (``"cuda"``).
    required_device: str = "any"
    #: Tokens per page of the CSR page lists (FlashInfer's ``indptr`` / ``indices`` /
    #: last-page lengths) the backend plans decode batches with, or ``None``. ``KVBackend``'s
    #: decode stager then builds them in its own launch (``StagedDecodeBatch.page_lists``).
    decode_page_list_size: int | None = None

    def __init__(self, config: AttentionConfig) -> None:
        pool, table = config.pool, config.page_table
        if pool.local_kv_heads != config.num_kv_heads or pool.head_dim != config.head_dim:
            raise InvalidArgumentError(
                f"the pool holds {pool.local_kv_heads} KV heads of dim {pool.head_dim}; the attention "
                f"config asks for {config.num_kv_heads} heads of dim {config.head_dim}"
            )
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype != torch.int32:
            raise InvalidArgumentError(
                f"page_table must be a 2-D int32 tensor, got {getattr(table, 'shape', table)!r} "
                f"{getattr(table, 'dtype', '')}"
            )
        if table.device != pool.device:
            raise InvalidArgumentError(f"page_table is on {table.device} but the pool is on {pool.device}")
        if self.required_device != "any" and pool.device.type != self.required_device:
            raise InvalidArgumentError(
                f"{type(self).__name__} needs a {self.required_device} pool, got one on {pool.device}"
            )
        self.config = config
        self.pool = pool
        self.page_table = table
        self.num_qo_heads = config.num_qo_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.group_size = config.num_qo_heads // config.num_kv_heads
        self.scale = config.softmax_scale
        self.page_size = pool.page_size
        self.num_locations = (pool.num_pages + 1) * pool.page_size
        self._flat_caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def flat_caches(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer by token location: each ``[num_locations, num_kv_heads, head_dim]``,
        pool dtype, pool device (views of the pool, made once per layer)."""
        views = self._flat_caches.get(layer_id)
        if views is None:
            shape = (self.num_locations, self.num_kv_heads, self.head_dim)
            views = (self.pool.k_cache(layer_id).view(shape), self.pool.v_cache(layer_id).view(shape))
            self._flat_caches[layer_id] = views
        return views

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: AttentionBatch
    ) -> torch.Tensor:
        if batch.metadata is None:
            raise InvalidArgumentError(f"call {type(self).__name__}.prepare_metadata(batch) before forward")
        n = batch.num_tokens
        q3 = self._as_heads(q, "q", n, self.num_qo_heads)
        k3 = self._as_heads(k, "k", n, self.num_kv_heads)
        v3 = self._as_heads(v, "v", n, self.num_kv_heads)
        self.pool.store_kv(k3, v3, batch.out_loc, layer_id)
        out = self._attend(q3, layer_id, batch)
        return out.view(n, self.num_qo_heads * self.head_dim)

    def _attend(self, q: torch.Tensor, layer_id: int, batch: AttentionBatch) -> torch.Tensor:
        """Attend ``q`` (``[num_tokens, num_qo_heads, head_dim]``) over the pool; returns a contiguous
        ``[num_tokens, num_qo_heads, head_dim]`` tensor in the pool dtype."""
        raise NotImplementedError

    def _as_heads(self, x: torch.Tensor, name: str, n: int, heads: int) -> torch.Tensor:
        dim = self.head_dim
        if not isinstance(x, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != self.pool.dtype or x.device != self.pool.device:
            raise InvalidArgumentError(
                f"{name} must be {self.pool.dtype} on {self.pool.device}, got {x.dtype} on {x.device}"
            )
        if x.shape == (n, heads, dim):
            return x if x.stride(-1) == 1 else x.contiguous()
        if x.shape == (n, heads * dim):
            return x.view(n, heads, dim) if x.stride(-1) == 1 else x.reshape(n, heads, dim)
        raise InvalidArgumentError(
            f"{name} must be shape [{n}, {heads * dim}] or [{n}, {heads}, {dim}] (num_tokens={n}, "
            f"heads={heads}, head_dim={dim}), got {tuple(x.shape)}"
        )


def check_metadata(backend: object, batch: AttentionBatch, expected: type) -> Any:
    """``batch.metadata`` if it is of the backend's type, else a clear error."""
    metadata = batch.metadata
    if not isinstance(metadata, expected):
        raise InvalidArgumentError(
            f"batch.metadata is {type(metadata).__name__}, expected {expected.__name__}: call "
            f"{type(backend).__name__}.prepare_metadata(batch) (or prepare_for_capture/replay) first"
        )
    return metadata
