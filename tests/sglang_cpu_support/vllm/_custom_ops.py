"""Plain-torch ``rotary_embedding`` with vLLM's ``_custom_ops`` signature (test-only stand-in).

SGLang 0.5.23's ``RotaryEmbedding`` calls it on a plain ``--device cpu`` server as
``rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)`` and relies on it
rotating ``query`` and ``key`` in place, as vLLM's kernel does.
"""

from __future__ import annotations

from typing import Optional

import torch


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotate the first ``rotary_dim`` dims of every head of ``query`` and ``key`` in place.

    Args:
        positions: shape ``[n]`` (or any shape with ``n`` elements), int, position of each token.
        query: shape ``[n, heads * head_size]`` (or ``[n, heads, head_size]``), float; may be a
            strided view (SGLang passes slices of its fused qkv tensor).
        key: like ``query`` with the KV heads, or ``None``.
        head_size: dims per head.
        cos_sin_cache: shape ``[max_position, rotary_dim]``, cos then sin halves, query's dtype.
        is_neox: NeoX style (rotate the two halves) or GPT-J style (rotate interleaved pairs).
    """
    positions = positions.reshape(-1)
    count = positions.shape[0]
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [n, 1, rotary_dim / 2], broadcast over heads
    for tensor in (query, key):
        if tensor is None:
            continue
        part = tensor.view(count, -1, head_size)[..., :rotary_dim]
        if is_neox:
            first, second = part.chunk(2, dim=-1)
            rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        else:
            first, second = part[..., 0::2], part[..., 1::2]
            rotated = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1).flatten(-2)
        part.copy_(rotated)
