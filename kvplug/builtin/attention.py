"""Built-in plugin: the attention backends. GPU libraries are imported inside each factory."""

from __future__ import annotations

from kvplug.hookspecs import hookimpl
from kvplug.interface import AttentionConfig, BaseAttentionBackend


def create_torch(config: AttentionConfig) -> BaseAttentionBackend:
    from kvplug.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(config)


@hookimpl
def kvplug_register_attention_backends(register):
    register("torch", create_torch)
