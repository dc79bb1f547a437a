"""Model shapes for ``kvplug bench e2e``: the Qwen3 geometries a host builds random-weight models of.

Nothing is downloaded: the host draws the weights from ``SEED`` (``E2EHost.build_model``; the
transformers adapter builds them in its ``e2e_bench`` module), so the generated tokens are
meaningless but the compute and the KV traffic per token are those of the named shape.
``qwen3-0.6b`` is the real geometry (28 layers, 16 query / 8 KV heads of 128, hidden 1024,
vocabulary 151,936), ``qwen3-4b`` Qwen3-4B's (36 layers, 32 query / 8 KV heads, hidden 2,560);
``qwen3-tiny`` keeps the Qwen3 structure at a size a 2-core CPU finishes in minutes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ModelShapeSpec(NamedTuple):
    """The Qwen3 config fields that fix a model's cost (everything else is Qwen3's default)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int


MODEL_SHAPES = {
    "qwen3-0.6b": ModelShapeSpec(1024, 3072, 28, 16, 8, 128, 151_936, 40_960),
    # 6.5x the compute per token of 0.6b for 1.3x its K/V bytes: where a host tier's copies pay off
    "qwen3-4b": ModelShapeSpec(2560, 9728, 36, 32, 8, 128, 151_936, 40_960),
    "qwen3-tiny": ModelShapeSpec(256, 768, 4, 4, 2, 64, 4096, 8192),
}
DEFAULT_SHAPE = {"cpu": "qwen3-tiny", "cuda": "qwen3-0.6b"}
SEED = 20261129


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (what a server runs), fp32 on CPU (bf16 matmuls are slow there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def describe_shape(shape_name: str) -> dict[str, int]:
    return MODEL_SHAPES[shape_name]._asdict()
