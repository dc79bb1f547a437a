"""Attention backends over the kvplug pool and page table (docs/design.md, section 4).

Only the torch-only pieces are imported here; the Triton, FlashInfer and FA3 backends live in
their own modules and import their GPU libraries when built (``kvplug.create_attention_backend``).
"""

from kvplug.attention.batch import build_attention_batch
from kvplug.attention.hybrid import HybridAttentionBackend
from kvplug.attention.torch_backend import TorchAttentionBackend

__all__ = ["HybridAttentionBackend", "TorchAttentionBackend", "build_attention_batch"]
