"""Built-in plugin: the attention backends.

GPU libraries are imported inside each factory, so listing or loading plugins never needs them;
asking for a backend whose library is missing raises an ``ImportError`` naming the pip extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.hookspecs import hookimpl

if TYPE_CHECKING:  # loading the built-ins must not import the tensor types (kvplug plugins stays fast)
    from kvplug.interface import AttentionConfig, BaseAttentionBackend


def create_torch(config: AttentionConfig) -> BaseAttentionBackend:
    from kvplug.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(config)


def create_triton(config: AttentionConfig) -> BaseAttentionBackend:
    from kvplug.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(config)


def create_flashinfer(config: AttentionConfig) -> BaseAttentionBackend:
    from kvplug.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(config)


def create_fa3(config: AttentionConfig) -> BaseAttentionBackend:
    from kvplug.attention.fa3_backend import FA3AttentionBackend

    return FA3AttentionBackend(config)


def create_auto(config: AttentionConfig) -> BaseAttentionBackend:
    from kvplug.attention.auto import create_auto_backend

    return create_auto_backend(config)


@hookimpl
def kvplug_register_attention_backends(register):
    register("torch", create_torch)
    register("triton", create_triton)
    register("flashinfer", create_flashinfer)
    register("fa3", create_fa3)
    register("auto", create_auto)
