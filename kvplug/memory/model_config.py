"""Reading the KV geometry of a model from a Hugging Face config, without torch.

``kvplug capacity`` needs only a handful of numbers (layers, query and KV heads, head size, the
KV element type's size), and it should answer in milliseconds, not after torch's second-long
import: this module reads them from a ``config.json`` mapping or an attribute-style config object
(``transformers.PretrainedConfig``) with the standard library only. ``ModelShape``
(``kvplug.memory.model_shape``) is built from the same reading, with a torch dtype.

Multimodal configs that nest the language model under ``text_config`` are read from there.
Missing ``head_dim`` means ``hidden_size / num_attention_heads``; missing ``num_key_value_heads``
means plain multi-head attention (as many KV heads as query heads).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, NamedTuple

from kvplug.interface import InvalidArgumentError
from kvplug.memory.tensor_parallel import local_kv_heads

#: KV element types kvplug supports, by canonical name, and their size in bytes
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: every spelling accepted for them (a torch dtype's ``str`` too: ``torch.bfloat16``)
DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}


def dtype_name(value: Any) -> str:
    """The canonical name (``bfloat16``, ``float16``, ``float32``) of a KV dtype given as a name
    or a torch dtype; ``InvalidArgumentError`` for anything else."""
    text = str(value).strip().lower().removeprefix("torch.")
    name = DTYPE_ALIASES.get(text)
    if name is None:
        raise InvalidArgumentError(f"unknown KV dtype {value!r}; expected one of {sorted(DTYPE_ALIASES)}")
    return name


class KVGeometry(NamedTuple):
    """A model's attention geometry (global, before tensor parallelism) and KV element type.

    Attributes:
        num_layers, num_qo_heads, num_kv_heads, head_dim: as in ``ModelShape``.
        dtype: the KV element type's canonical name (``dtype_name``).
    """

    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def kv_bytes_per_token(self, tp_size: int = 1) -> int:
        """K and V bytes of one token over all layers, on one rank of ``tp_size``."""
        return 2 * self.num_layers * local_kv_heads(self.num_kv_heads, tp_size) * self.head_dim * DTYPE_SIZES[self.dtype]


def read_hf_config(config: Mapping[str, Any] | Any, dtype: Any = None) -> KVGeometry:
    """The geometry of a HF config (mapping or attribute object); ``dtype`` overrides the config's
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
    chosen = dtype if dtype is not None else (config_dtype or "bfloat16")
    return KVGeometry(num_layers, num_qo_heads, num_kv_heads, head_dim, dtype_name(chosen))


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a local model directory, or the file itself, as a mapping."""
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
    return data


def _as_mapping(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return {name: getattr(config, name) for name in dir(config) if not name.startswith("_")}


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
