"""Which vLLM requests may share cached KV: the namespace of a request.

vLLM folds the LoRA adapter, ``cache_salt`` and multimodal inputs into its block hashes ("extra
keys"), so equal token ids under different adapters, salts or images never share blocks. kvplug's
prefix caches key by token ids only (and multimodal placeholders are equal token ids for any
image), so the adapter gives each combination its own cache (``block_cache``): the namespace is
``((LoRA adapter id, name, path), cache_salt, ((input identifier, placeholder offset), ...))``
(vLLM's hash keys the adapter by name and path: one re-pointed at other weights is another
namespace). Two prompts with the same image at the same place share; a text prefix before
different images does not (vLLM would share it; kvplug trades that hit away for never reusing KV
computed with another image). A prompt given as embeddings (``prompt_embeds``: its token ids are
placeholders) adds the SHA-256 of its embeddings: only identical embedded prompts share (vLLM
shares per block; kvplug trades that away too), computed once per request.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any, Hashable

import torch

DEFAULT_NAMESPACE: Hashable = (None, None, ())
_EMBEDS_DIGESTS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def namespace_of(request: Any) -> Hashable:
    """The namespace of a ``vllm.v1.request.Request`` (``DEFAULT_NAMESPACE`` for plain text, no LoRA)."""
    lora = request.lora_request
    lora_id = (lora.lora_int_id, lora.lora_name, lora.lora_path) if lora is not None else None
    features = tuple(
        (feature.identifier, feature.mm_position.offset) for feature in (request.mm_features or ())
    )
    namespace = (lora_id, request.cache_salt, features)
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return namespace
    return namespace + (("prompt_embeds", embeds_digest(request, embeds)),)


def embeds_digest(request: Any, embeds: Any) -> str:
    """SHA-256 of a request's prompt embeddings (its bytes, dtype and shape), once per request."""
    try:
        digest = _EMBEDS_DIGESTS.get(request)
    except TypeError:  # not weakly referenceable (vLLM's Request is): no memo
        return _digest(embeds)
    if digest is None:
        digest = _EMBEDS_DIGESTS[request] = _digest(embeds)
    return digest


def _digest(embeds: Any) -> str:
    tensor = embeds.detach().cpu().contiguous()
    data = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    data.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return data.hexdigest()
