"""Which vLLM requests may share cached KV: the namespace of a request.

vLLM folds the LoRA adapter, ``cache_salt`` and multimodal inputs into its block hashes ("extra
keys"), so equal token ids under different adapters, salts or images never share blocks. kvplug's
prefix caches key by token ids only (and multimodal placeholders are equal token ids for any
image), so the adapter gives each combination its own cache (``block_cache``): the namespace is
``((LoRA adapter id, name, path), cache_salt, ((input identifier, placeholder offset), ...))``
(vLLM's hash keys the adapter by name and path: one re-pointed at other weights is another namespace). Two prompts with
the same image at the same place share; a text prefix before different images does not (vLLM
would share it; kvplug trades that hit away for never reusing KV computed with another image).
"""

from __future__ import annotations

from typing import Any, Hashable

DEFAULT_NAMESPACE: Hashable = (None, None, ())


def namespace_of(request: Any) -> Hashable:
    """The namespace of a ``vllm.v1.request.Request`` (``DEFAULT_NAMESPACE`` for plain text, no LoRA)."""
    lora = request.lora_request
    lora_id = (lora.lora_int_id, lora.lora_name, lora.lora_path) if lora is not None else None
    features = tuple(
        (feature.identifier, feature.mm_position.offset) for feature in (request.mm_features or ())
    )
    return (lora_id, request.cache_salt, features)
