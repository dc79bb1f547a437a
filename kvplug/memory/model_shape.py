"""``ModelShape``: the few numbers of a model that size its KV cache, read from a HF config.

Accepts a ``config.json`` mapping or an attribute-style object (``transformers.PretrainedConfig``).
Multimodal configs that nest the language model under ``text_config`` are read from there.
Missing ``head_dim`` means ``hidden_size / num_attention_heads``; missing ``num_key_value_heads``
means plain multi-head attention (as many KV heads as query heads).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from kvplug.interface import SUPPORTED_KV_DTYPES, InvalidArgumentError

DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


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
        ``torch_dtype`` / ``dtype``, and bf16 is used when neither is given."""
        fields = _as_mapping(config)
        if "num_hidden_layers" not in fields and fields.get("text_config") is not None:
            dtype_fields = {key: fields[key] for key in ("torch_dtype", "dtype") if fields.get(key) is not None}
            fields = {**dtype_fields, **_as_mapping(fields["text_config"])}
        num_layers = _require_int(fields, "num_hidden_layers")
        num_qo_heads = _require_int(fields, "num_attention_heads")
        num_kv_heads = _optional_int(fields, "num_key_value_heads") or num_qo_heads
        head_dim = _optional_int(fields, "head_dim")
        if head_dim is None:
            hidden_size = _require_int(fields, "hidden_size", why="to derive head_dim, which is absent")
            if hidden_size % num_qo_heads:
                raise InvalidArgumentError(
                    f"config has no head_dim and hidden_size ({hidden_size}) is not a multiple of "
                    f"num_attention_heads ({num_qo_heads})"
                )
            head_dim = hidden_size // num_qo_heads
        config_dtype = fields.get("torch_dtype") or fields.get("dtype")
        chosen = dtype if dtype is not None else (config_dtype or torch.bfloat16)
        return cls(num_layers, num_qo_heads, num_kv_heads, head_dim, parse_dtype(_dtype_text(chosen)))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: str | torch.dtype | None = None) -> "ModelShape":
        """Read ``config.json`` from a local model directory or a path to the file itself."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
        try:
            with open(file, encoding="utf-8") as handle:
                data = json.load(handle)
        except OSError as error:
            raise InvalidArgumentError(f"cannot read model config {file!r}: {error.strerror or error}") from None
        except json.JSONDecodeError as error:
            raise InvalidArgumentError(f"model config {file!r} is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"model config {file!r} must hold a JSON object, got {type(data).__name__}")
        return cls.from_hf_config(data, dtype=dtype)


def _as_mapping(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return {name: getattr(config, name) for name in dir(config) if not name.startswith("_")}


def _dtype_text(value: Any) -> str | torch.dtype:
    return value if isinstance(value, (str, torch.dtype)) else str(value)


def _optional_int(fields: Mapping[str, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"config field {name} must be a positive int, got {value!r}")
    return value


def _require_int(fields: Mapping[str, Any], name: str, why: str = "") -> int:
    value = _optional_int(fields, name)
    if value is None:
        raise InvalidArgumentError(f"config has no {name}{' ' + why if why else ''}; is this a decoder LLM config?")
    return value
