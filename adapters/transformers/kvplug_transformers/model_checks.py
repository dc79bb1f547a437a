"""Start-up checks of what a checkpoint's ``config.json`` decides, before the weights load: a model
``kvplug serve`` cannot serve is refused with the reason at start, never at its first request."""

from __future__ import annotations

from typing import Any

import torch

from kvplug.interface import InvalidArgumentError

CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
SERVABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_model_config(config: Any, model_path: str, kv_backend: str, kv_dtype: torch.dtype) -> None:
    """Raise ``InvalidArgumentError`` naming the ``config.json`` field for a model this server cannot run.

    Args:
        config: the checkpoint's transformers ``PretrainedConfig``.
        kv_backend: ``"kvplug"`` or ``"native"`` (only kvplug's cache needs all-full-attention layers).
        kv_dtype: the dtype the model and the KV cache run in.
    """
    where = f"{model_path}/config.json"
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures and not any(name.endswith(CAUSAL_LM_SUFFIXES) for name in architectures):
        raise InvalidArgumentError(
            f"kvplug serve serves causal language models (an architecture ending in ForCausalLM); architectures in "
            f"{where} is {architectures}: transformers' continuous batching does not run it"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None) or None
    head_dim = getattr(text, "head_dim", None)
    hidden = getattr(text, "hidden_size", None)
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        if hidden % heads:
            raise InvalidArgumentError(
                f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} in {where} and head_dim is not "
                "given: the head dimension is undefined"
            )
        head_dim = hidden // heads
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 1):
        raise InvalidArgumentError(f"head_dim in {where} must be a positive int, got {head_dim!r}")
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        raise InvalidArgumentError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} in {where}: "
            "grouped-query attention needs whole groups"
        )
    if kv_dtype not in SERVABLE_DTYPES:
        raise InvalidArgumentError(
            f"the model's dtype {kv_dtype} (dtype in {where}, or --dtype) cannot be served: give --dtype bfloat16, "
            "float16 or float32"
        )
    if kv_backend == "kvplug":
        layer_types = sorted(set(_layer_types(config)))
        if layer_types and layer_types != ["full_attention"]:
            window = getattr(text, "sliding_window", None)
            raise InvalidArgumentError(
                f"kvplug's KV cache serves models whose layers are all full attention; {where} gives "
                f"{layer_types} layers (sliding_window {window}): serve it with --kv-backend native"
            )


def _layer_types(config: Any) -> list[str]:
    """Each layer's attention type as transformers' continuous batching groups them."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    _, group_types = group_layers_by_attn_type(config)
    return list(group_types)
