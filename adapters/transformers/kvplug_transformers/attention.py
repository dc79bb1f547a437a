"""The ``paged|kvplug`` attention function transformers' models call once per layer.

transformers' attention modules hand it the layer's projected (and rotated) query, key and value
plus the continuous-batching kwargs, among them ``cache``: the kvplug-backed cache, which knows
the step's ``AttentionBatch``. The function reshapes to kvplug's token-major layout and lets the
cache's kvplug attention backend store the new K/V and attend over the pool.
"""

from __future__ import annotations

from typing import Any

import torch

from kvplug.interface import InvalidArgumentError

ATTENTION_NAME = "paged|kvplug"


# Kept out of torch.compile (the setting ``torch_compile`` compiles the model around it): it reads
# the step's batch from host state and launches kvplug's own kernels, so a compiled model breaks
# its graph here, once per layer, and fuses the rest. Traced, it would also recompile per layer
# (each layer's module and layer index are guarded constants) until dynamo's cache limit.
@torch.compiler.disable
def kvplug_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over kvplug's pool for one layer of a continuous-batching step.

    Args:
        module: the attention module; ``module.layer_idx`` is the pool layer.
        query: shape ``[1, num_qo_heads, num_tokens, head_dim]``, model dtype, device.
        key, value: shape ``[1, num_kv_heads, num_tokens, head_dim]``, model dtype, device.
        attention_mask: ignored (kvplug's batch description carries the causal structure).
        scaling: softmax scale; ``None`` means ``head_dim ** -0.5``.
        kwargs: transformers' paged-attention kwargs; ``cache`` must be the kvplug cache.

    Returns:
        ``(output, None)``, output shape ``[1, num_tokens, num_qo_heads, head_dim]``.
    """
    cache = kwargs.get("cache")
    if cache is None or not hasattr(cache, "attention_forward"):
        raise InvalidArgumentError(
            f"attention implementation {ATTENTION_NAME!r} runs only inside transformers' continuous batching "
            "with kvplug installed (kvplug_transformers.install()); for a plain forward use 'sdpa'. "
            f"Got cache={type(cache).__name__}"
        )
    if dropout:
        raise InvalidArgumentError(f"{ATTENTION_NAME} is inference-only; got dropout={dropout}")
    layer_id = getattr(module, "layer_idx", None)
    if not isinstance(layer_id, int):
        raise InvalidArgumentError(f"{type(module).__name__} has no integer layer_idx; {ATTENTION_NAME} needs one")
    num_tokens, head_dim = query.shape[2], query.shape[3]
    # [1, H, T, D] -> [T, H, D]: kvplug is token-major
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    out = cache.attention_forward(layer_id, q, k, v, scaling)
    return out.view(1, num_tokens, -1, head_dim), None


def register_attention_function(modeling_utils: Any) -> None:
    """Make ``paged|kvplug`` a valid ``attn_implementation`` for every transformers model."""
    modeling_utils.AttentionInterface.register(ATTENTION_NAME, kvplug_paged_attention)
