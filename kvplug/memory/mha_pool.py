"""``mha``: the KV pool for multi-head / grouped-query attention (docs/design.md, sections 1 and 4).

One tensor ``[2, num_layers, num_pages + 1, page_size, local_kv_heads, head_dim]`` allocated once.
The trailing page is the dummy page: padded CUDA-graph slots write there and nowhere else.

Options (``KVPoolConfig.options``):

- ``validate`` (bool, default ``True``): ``store_kv`` also checks that every ``out_loc`` lies in
  the pool. That check reads the locations back to the host, a device sync per call on CUDA, so
  serving on a GPU should pass ``False`` (``kvplug.create_backend`` does unless told otherwise).
  It is skipped while a CUDA graph is being captured, where a sync is illegal. Dtype, device,
  shape and layer checks are host-only and always run.
- ``store_kernel`` (``"auto"`` | ``"torch"`` | ``"triton"``, default ``"auto"``): on CUDA,
  ``auto`` uses kvplug's Triton store kernel when Triton imports and falls back to torch indexing
  otherwise; on CPU the torch path is always used.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable

import torch

from kvplug.interface import BaseKVPool, InvalidArgumentError, KVPoolConfig, OutOfMemoryError
from kvplug.memory.tensor_parallel import local_kv_heads
from kvplug.tensor_checks import check_int32_vector

logger = logging.getLogger(__name__)

KNOWN_OPTIONS = frozenset({"validate", "store_kernel"})
STORE_KERNELS = ("auto", "torch", "triton")

# store(k_cache_flat, v_cache_flat, out_loc, k, v); caches [num_locations, H, D], k/v [n, H, D]
StoreFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class MHAKVPool(BaseKVPool):
    """Per-layer K/V storage addressed by token location.

    Args:
        config: shape, dtype, device and tensor-parallel placement; ``config.num_kv_heads`` is the
            model's global count and the pool keeps this rank's share.
    """

    def __init__(self, config: KVPoolConfig) -> None:
        unknown = set(config.options) - KNOWN_OPTIONS
        if unknown:
            raise InvalidArgumentError(
                f"unknown mha pool options {sorted(unknown)}; expected a subset of {sorted(KNOWN_OPTIONS)}"
            )
        store_kernel = config.options.get("store_kernel", "auto")
        if store_kernel not in STORE_KERNELS:
            raise InvalidArgumentError(f"store_kernel must be one of {STORE_KERNELS}, got {store_kernel!r}")
        if store_kernel == "triton" and config.device.type != "cuda":
            raise InvalidArgumentError(f"store_kernel='triton' needs a CUDA pool, got device {config.device}")
        self._config = config
        self._local_kv_heads = local_kv_heads(config.num_kv_heads, config.tp_size)
        self._validate = bool(config.options.get("validate", True))
        self._store_kernel = store_kernel
        self._store: StoreFunction | None = None
        # zeros, not empty: attention over padded slots multiplies dummy-page V by zero weights,
        # and uninitialised memory may hold NaN, which survives that multiplication
        shape = (2, config.num_layers, config.num_pages + 1, config.page_size, self._local_kv_heads, config.head_dim)
        try:
            self._kv_buffer = torch.zeros(shape, dtype=config.dtype, device=config.device)
        except (RuntimeError, MemoryError) as error:  # torch's allocation failures (CPU and CUDA)
            raise OutOfMemoryError(
                f"cannot allocate the KV pool {list(shape)} of {config.dtype} on {config.device} "
                f"({config.num_pages:,} pages x {config.page_size} tokens): {type(error).__name__}: "
                f"{str(error).splitlines()[0][:200]}"
            ) from error
        # the buffer's device carries the index ("cuda" -> "cuda:0"), which tensor checks compare to
        self._device = self._kv_buffer.device
        self._num_locations = (config.num_pages + 1) * config.page_size

    # ------------------------------------------------------------------ shape and placement
    @property
    def config(self) -> KVPoolConfig:
        return self._config

    @property
    def num_layers(self) -> int:
        return self._config.num_layers

    @property
    def num_pages(self) -> int:
        return self._config.num_pages

    @property
    def page_size(self) -> int:
        return self._config.page_size

    @property
    def local_kv_heads(self) -> int:
        return self._local_kv_heads

    @property
    def head_dim(self) -> int:
        return self._config.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self._config.dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_locations(self) -> int:
        """Token locations including the dummy page: ``(num_pages + 1) * page_size``."""
        return self._num_locations

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers, on this rank."""
        element_size = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self._local_kv_heads * self.head_dim * element_size

    @property
    def kv_buffer(self) -> torch.Tensor:
        """The whole pool: shape ``[2, num_layers, num_pages + 1, page_size, local_kv_heads, head_dim]``."""
        return self._kv_buffer

    # ------------------------------------------------------------------ per-layer views
    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self._kv_buffer[0, self._check_layer(layer_id)]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self._kv_buffer[1, self._check_layer(layer_id)]

    def flat_k_cache(self, layer_id: int) -> torch.Tensor:
        """K of one layer by token location: shape ``[(num_pages + 1) * page_size, local_kv_heads, head_dim]``."""
        return self.k_cache(layer_id).view(self._num_locations, self._local_kv_heads, self.head_dim)

    def flat_v_cache(self, layer_id: int) -> torch.Tensor:
        """V of one layer by token location, same shape as ``flat_k_cache``."""
        return self.v_cache(layer_id).view(self._num_locations, self._local_kv_heads, self.head_dim)

    # ------------------------------------------------------------------ writing
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        """Write K/V rows at token locations (see ``BaseKVPool.store_kv``).

        Args:
            k, v: shape ``[n, local_kv_heads * head_dim]`` or ``[n, local_kv_heads, head_dim]``,
                pool dtype, pool device.
            out_loc: shape ``[n]``, int32, pool device; in ``[0, num_locations)`` (checked when
                the ``validate`` option is on).
            layer_id: in ``[0, num_layers)``.
        """
        layer_id = self._check_layer(layer_id)
        self._check_location_tensor(out_loc)
        k3 = self._as_heads(k, "k", out_loc.shape[0])
        v3 = self._as_heads(v, "v", out_loc.shape[0])
        if out_loc.shape[0] == 0:
            return
        if self._validate and not _capturing(self.device):
            self._check_location_range(out_loc)
        self._store_function()(self.flat_k_cache(layer_id), self.flat_v_cache(layer_id), out_loc, k3, v3)

    def _store_function(self) -> StoreFunction:
        if self._store is None:
            self._store = _torch_store
            if self.device.type == "cuda" and self._store_kernel != "torch":
                self._store = _load_triton_store(required=self._store_kernel == "triton") or _torch_store
            logger.debug("mha pool on %s stores KV with %s", self.device, self._store.__name__)
        return self._store

    # ------------------------------------------------------------------ validation
    def _check_layer(self, layer_id: int) -> int:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < self.num_layers:
            raise InvalidArgumentError(f"layer_id must be an int in [0, {self.num_layers}), got {layer_id!r}")
        return layer_id

    def _check_location_tensor(self, out_loc: torch.Tensor) -> None:
        check_int32_vector(out_loc, self.device, "out_loc")

    def _check_location_range(self, out_loc: torch.Tensor) -> None:
        # the only check that reads device data (a sync on CUDA); see the ``validate`` option
        low, high = int(out_loc.min()), int(out_loc.max())
        if low < 0 or high >= self._num_locations:
            raise InvalidArgumentError(
                f"out_loc must lie in [0, {self._num_locations}) (the pool's token locations, dummy page "
                f"included), got values in [{low}, {high}]"
            )

    def _as_heads(self, x: torch.Tensor, name: str, n: int) -> torch.Tensor:
        heads, dim = self._local_kv_heads, self.head_dim
        if not isinstance(x, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != self.dtype or x.device != self.device:
            raise InvalidArgumentError(
                f"{name} must be {self.dtype} on {self.device}, got {x.dtype} on {x.device}"
            )
        if tuple(x.shape) == (n, heads, dim):
            return x
        if tuple(x.shape) == (n, heads * dim):
            return x.view(n, heads, dim) if x.is_contiguous() else x.reshape(n, heads, dim)
        raise InvalidArgumentError(
            f"{name} must be shape [{n}, {heads * dim}] or [{n}, {heads}, {dim}] (n = len(out_loc), "
            f"local_kv_heads={heads}, head_dim={dim}), got {tuple(x.shape)}"
        )


def _torch_store(
    k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    # advanced indexing accepts int32 indices directly, saving an int64 copy of out_loc
    k_cache[out_loc] = k
    v_cache[out_loc] = v


def _load_triton_store(*, required: bool) -> StoreFunction | None:
    try:
        importlib.import_module("triton")  # the kernel module needs it; fail here with a clear message
        from kvplug.kernels.store_kv import store_kv_triton
    except ImportError as error:
        if required:
            raise InvalidArgumentError(
                f"store_kernel='triton' needs Triton and kvplug.kernels.store_kv: {error}. "
                "Install it with `pip install -e \".[triton]\"` from the kvplug repository"
            ) from error
        logger.info("Triton store kernel unavailable (%s); the mha pool uses torch indexing", error)
        return None
    return store_kv_triton


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
