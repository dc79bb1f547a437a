"""``ModelShape``: the few numbers of a model that size its KV cache, with its KV dtype as a torch
dtype; read from a HF config by ``kvplug.memory.model_config`` (which needs no torch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from kvplug.interface import SUPPORTED_KV_DTYPES, InvalidArgumentError
from kvplug.memory.model_config import DTYPE_ALIASES, load_config_file, read_hf_config

DTYPE_NAMES: dict[str, torch.dtype] = {alias: getattr(torch, name) for alias, name in DTYPE_ALIASES.items()}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """A KV dtype from a torch dtype or a name (``bf16``, ``bfloat16``, ``fp16``, ``float32``, ...)."""
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.strip().lower().removeprefix("torch.") in DTYPE_NAMES:
        dtype = DTYPE_NAMES[value.strip().lower().removeprefix("torch.")]
    else:
        raise InvalidArgumentError(f"unknown KV dtype {value!r}; expected one of {sorted(DTYPE_NAMES)}")
    if dtype not in SUPPORTED_KV_DTYPES:
        raise InvalidArgumentError(f"KV dtype must be one of {SUPPORTED_KV_DTYPES}, got {dtype}")
    return dtype


@dataclass(frozen=True)
class ModelShape:
    """Attention geometry of a model (global, before tensor parallelism).

    Attributes:
        num_layers: attention layers.
        num_qo_heads: query heads.
        num_kv_heads: key/value heads (GQA: fewer than query heads).
        head_dim: elements per head.
        dtype: KV element type.
    """

    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"ModelShape.{name} must be a positive int, got {value!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    def kv_bytes_per_token(self, tp_size: int = 1) -> int:
        """K and V bytes of one token over all layers, on one rank of ``tp_size``."""
        from kvplug.memory.tensor_parallel import local_kv_heads

        element_size = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * local_kv_heads(self.num_kv_heads, tp_size) * self.head_dim * element_size

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any, dtype: str | torch.dtype | None = None) -> "ModelShape":
        """Read a HF config (mapping or attribute object); ``dtype`` overrides the config's
        ``torch_dtype`` / ``dtype``, and bf16 is used when neither is given
        (``kvplug.memory.model_config.read_hf_config``)."""
        geometry = read_hf_config(config, dtype)
        return cls(geometry.num_layers, geometry.num_qo_heads, geometry.num_kv_heads, geometry.head_dim,
                   parse_dtype(geometry.dtype))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: str | torch.dtype | None = None) -> "ModelShape":
        """Read ``config.json`` from a local model directory or a path to the file itself."""
        return cls.from_hf_config(load_config_file(path), dtype=dtype)
