"""kvplug's KV cache events, published the way SGLang's ``RadixCache`` publishes its own.

With ``--kv-events-config``, SGLang's scheduler takes each tree cache's events
(``BasePrefixCache.take_events`` -> ``self.kv_events``, a ``KVCacheEventRecorder``) and publishes
them (ZMQ by default) to cache-aware routers. ``SGLangEventTranslator`` listens to one kvplug
cache (one namespace of ``KvplugPrefixCache``) and enqueues on that recorder exactly what
``RadixCache`` records for the same pages: one ``BlockStored`` per page (the recorder coalesces
chained pages as it does for SGLang's own), ``BlockRemoved`` per evicted node, with SGLang's
per-page block hashes (SHA-256 chained by the parent page's hash, from SGLang's own hash
functions), token ids, block size and medium, namespaced as SGLang namespaces them (LoRA
``extra_key``, ``cache_salt``, Dynamo format). With a host-memory tier each event carries its
medium as SGLang's HiCache names it: ``StorageMedium.GPU`` for the KV pool, ``StorageMedium.CPU``
for host memory (a write-back removes a page on ``GPU`` and stores it on ``CPU``; a load stores it
on ``GPU`` while its host copy stays stored on ``CPU``).

kvplug's events carry kvplug's page hashes (``kvplug.prefix_cache.block_hashes``); the translator
keeps, per cached page, the SGLang hash it published for it and the media holding the page, so a
removal names the same hash and a child page chains to its parent's SGLang hash. A page may be
held in both media at once (a loaded prefix keeps its host copy): its entry lives until its last
medium removes it. The map holds one entry per cached page.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any, Optional

from kvplug.interface import KV_MEDIUM_DEVICE, KV_MEDIUM_HOST, AllCleared, BlockRemoved, BlockStored
from sglang.srt.disaggregation.kv_events import BlockRemoved as SGLangBlockRemoved
from sglang.srt.disaggregation.kv_events import BlockStored as SGLangBlockStored
from sglang.srt.disaggregation.kv_events import StorageMedium, kv_event_namespace_seed, namespaced_block_hash
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

# kvplug's media as SGLang names them: KV_MEDIUM_DEVICE ("GPU") is the device tier, KV_MEDIUM_HOST
# ("CPU") the host-memory tier, which SGLang's HiCache publishes as StorageMedium.CPU ("CPU_PINNED")
_MEDIUM = {KV_MEDIUM_DEVICE: StorageMedium.GPU, KV_MEDIUM_HOST: StorageMedium.CPU}


class SGLangEventTranslator:
    """kvplug events of one namespace's cache -> SGLang events on ``recorder``.

    Args:
        recorder: SGLang's ``KVCacheEventRecorder`` of the tree cache (enabled).
        extra_key, cache_salt: the namespace (``RadixKey.extra_key`` / ``cache_salt``).
    """

    def __init__(self, recorder: Any, extra_key: Optional[str], cache_salt: Optional[str]) -> None:
        self.recorder = recorder
        self.extra_key = extra_key
        self.cache_salt = cache_salt
        self._sglang_hex: dict[int, str] = {}  # kvplug page hash -> SGLang's hash string of the page
        self._media: dict[int, set[str]] = {}  # kvplug page hash -> the media holding the page

    def __call__(self, event: Any) -> None:
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            self._removed(event)
        elif isinstance(event, AllCleared):  # the tree cache reports AllBlocksCleared once per reset itself
            for kvplug_hash in list(self._media):
                self._forget(kvplug_hash, event.medium)

    def _stored(self, event: BlockStored) -> None:
        page_size = event.block_size
        if event.parent_block_hash is None:
            parent_hex = self._root_prior()
            parent_hash: Optional[int] = None
        else:
            parent_hex = self._sglang_hex[event.parent_block_hash]
            parent_hash = hash_str_to_int64(parent_hex)
        key = RadixKey(array("q", event.token_ids), self.extra_key, cache_salt=self.cache_salt)
        hexes = get_hash_str(key, parent_hex, page_size=page_size)
        seed = self._namespace_seed()
        if parent_hash is not None:
            parent_hash = namespaced_block_hash(parent_hash, namespace_seed=seed)
        lora_name = self._lora_name()
        medium = _MEDIUM.get(event.medium, event.medium)
        for number, (kvplug_hash, hex_hash) in enumerate(zip(event.block_hashes, hexes)):
            self._sglang_hex[kvplug_hash] = hex_hash
            self._media.setdefault(kvplug_hash, set()).add(event.medium)
            block_hash = namespaced_block_hash(hash_str_to_int64(hex_hash), namespace_seed=seed)
            self.recorder.enqueue(
                SGLangBlockStored(
                    block_hashes=[block_hash],
                    parent_block_hash=parent_hash,
                    token_ids=list(event.token_ids[number * page_size : (number + 1) * page_size]),
                    block_size=page_size,
                    lora_id=None,
                    medium=medium,
                    cache_salt=self.cache_salt,
                    session_id=None,
                    lora_name=lora_name,
                )
            )
            parent_hash = block_hash

    def _removed(self, event: BlockRemoved) -> None:
        seed = self._namespace_seed()
        hashes = [
            namespaced_block_hash(hash_str_to_int64(self._forget(kvplug_hash, event.medium)), namespace_seed=seed)
            for kvplug_hash in event.block_hashes
        ]
        if hashes:
            self.recorder.enqueue(SGLangBlockRemoved(block_hashes=hashes, medium=_MEDIUM.get(event.medium, event.medium)))

    def _forget(self, kvplug_hash: int, medium: str) -> str:
        """The page's SGLang hash string; the page is no longer held in ``medium`` (nor anywhere,
        once its last medium let it go)."""
        hex_hash = self._sglang_hex[kvplug_hash]
        media = self._media[kvplug_hash]
        media.discard(medium)
        if not media:
            del self._sglang_hex[kvplug_hash], self._media[kvplug_hash]
        return hex_hash

    # SGLang's rules (sglang.srt.mem_cache.events / utils), for this namespace
    def _root_prior(self) -> Optional[str]:
        """The hash a namespace's first page chains to: none, or the salt's seed."""
        if self.cache_salt is None:
            return None
        return hashlib.sha256(b"sglang-cache-salt-v1\0" + self.cache_salt.encode("utf-8")).hexdigest()

    def _namespace_seed(self) -> Optional[bytes]:
        names = self.recorder.lora_names
        if self.recorder.dynamo_format:
            return kv_event_namespace_seed(extra_key=self.extra_key, cache_salt=self.cache_salt)
        extra_key = self.extra_key if names.get(self.extra_key) is not None else None
        return kv_event_namespace_seed(extra_key=extra_key, cache_salt=None)

    def _lora_name(self) -> Optional[str]:
        names = self.recorder.lora_names
        return names.resolve(self.extra_key) if self.recorder.dynamo_format else names.get(self.extra_key)
