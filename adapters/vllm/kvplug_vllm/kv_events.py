"""kvplug's KV events published by vLLM's own publisher (``--kv-events-config``), with vLLM's hashes.

kvplug replaces vLLM's hash index, so the block pool's events (``KVCacheManager.take_events``)
describe nothing that is cached. The seam vLLM 0.32.0 offers instead is the connector's
``take_events``: ``Scheduler.update_from_output`` publishes what it returns, with the manager's
events, once per step. ``VLLMEventRecorder`` gives every namespace's cache (``BlockPrefixCache``)
its own listener, ``NamespaceEvents``, which turns kvplug's ``BlockStored`` / ``BlockRemoved`` /
``AllCleared`` into vLLM's event classes as vLLM's block pool builds them for the same blocks.

Hashes: kvplug's page hashes (``kvplug.prefix_cache.block_hashes``) are over token ids alone, equal
for equal tokens under another LoRA adapter, ``cache_salt`` or image, so a router reading them would
conflate namespaces. vLLM's own hash of a block chains its parent's hash, its tokens and its extra
keys (LoRA name and path, multimodal identifiers and offsets, the first block's ``cache_salt``,
prompt-embedding digests); the engine core computes it for every request (``request.block_hashes``,
its connector being set). A cache inserts a request's blocks while that request is the namespace's
``context`` (``BlockPrefixCache.insert``), so each newly stored page gets the request's hash at its
position, converted as vLLM converts (``maybe_convert_block_hash``), with vLLM's ``lora_id``,
``lora_name``, per-block ``extra_keys``, ``group_idx`` and ``session_id``: the events a router
receives are the ones native vLLM would publish for the same blocks. The listener keeps, per cached
page, that hash and the media holding the page, so a removal, a write-back to the host tier
(``BlockRemoved`` on ``GPU``, ``BlockStored`` on ``CPU_PINNED``: ``kvplug.events.wire.WIRE_MEDIUM``)
and a load back name the same hash. A page stored without a context (a plugin storing on its own)
gets a hash of the namespace and kvplug's hash, counted in ``unmatched_pages``.

Two namespaces can hold blocks of one vLLM hash (the text before different images: kvplug keeps
them apart, vLLM would share them): the recorder publishes a hash's ``BlockStored`` when its first
holder stores it on a medium and its ``BlockRemoved`` when the last one lets it go.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, Hashable, NamedTuple, Optional

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

from kvplug.events.wire import WIRE_MEDIUM
from kvplug.interface.prefix_cache import AllCleared
from kvplug.interface.prefix_cache import BlockRemoved as KvplugBlockRemoved
from kvplug.interface.prefix_cache import BlockStored as KvplugBlockStored

_GROUP = 0  # kvplug serves one KV cache group (``prefix_caching.install`` refuses others)


class _Page(NamedTuple):
    """What a cached page was published as: vLLM's hash, its position (block index) in the
    sequence and its extra keys (the event's per-block entry)."""

    external: Any
    index: int
    extra_keys: Any


class _Lora(NamedTuple):
    lora_id: Optional[int]
    lora_name: Optional[str]


def vllm_block_hashes(request: Any, block_size: int, hash_block_size: int) -> Any:
    """``request``'s hash of each whole block of ``block_size`` tokens, as vLLM's block pool reads
    them (``resolve_block_hashes`` of the engine's ``request.block_hashes``): raw, unconverted."""
    return resolve_block_hashes(request.block_hashes, hash_block_size, block_size)


def block_extra_keys(request: Any, index: int, block_size: int) -> Any:
    """The extra keys of ``request``'s block ``index`` as vLLM's events carry them (untagged)."""
    start = index * block_size
    keys, _ = generate_block_hash_extra_keys(request, start, start + block_size, 0)
    return keys


class NamespaceEvents:
    """The kvplug event listener of one namespace's cache (see the module docstring).

    ``context``: the vLLM request whose blocks the cache is inserting (set by ``BlockPrefixCache``
    around the insert), or ``None``.
    """

    def __init__(self, recorder: "VLLMEventRecorder", namespace: Hashable) -> None:
        self.recorder = recorder
        self.namespace = namespace
        self.context: Any = None
        self._pages: dict[int, _Page] = {}  # kvplug page hash -> what it was published as
        self._media: dict[int, set[str]] = {}  # kvplug page hash -> kvplug media holding it
        # pages no medium holds since the last step: a write-back removes a page from the device
        # before storing it on the host, and the host copy must carry the same hash
        self._recent: dict[int, _Page] = {}
        self._lora = _Lora(None, None)
        self.unmatched_pages = 0

    def __call__(self, event: Any) -> None:
        if isinstance(event, KvplugBlockStored):
            self._stored(event)
        elif isinstance(event, KvplugBlockRemoved):
            self._removed(event.block_hashes, event.medium)
        elif isinstance(event, AllCleared):
            self.forget(event.medium)
            self.recorder.all_cleared()

    # ------------------------------------------------------------------ stored
    def _stored(self, event: KvplugBlockStored) -> None:
        request = self.context
        size = event.block_size
        if request is not None and request.lora_request is not None:
            lora = request.lora_request
            self._lora = _Lora(lora.lora_int_id, lora.lora_name)
        hashes = None
        if request is not None:
            hashes = vllm_block_hashes(request, size, self.recorder.hash_block_size)
        parent = self._known(event.parent_block_hash) if event.parent_block_hash is not None else None
        index = parent.index + 1 if parent is not None else 0
        pages = []
        for number, kvplug_hash in enumerate(event.block_hashes):
            page = self._pages.get(kvplug_hash)
            if page is None:
                page = self._recent.pop(kvplug_hash, None)
                if page is None:
                    page = self._new_page(kvplug_hash, index + number, request, hashes, size)
                self._pages[kvplug_hash] = page
            media = self._media.setdefault(kvplug_hash, set())
            pages.append((page, event.medium not in media))  # already held there: not stored again
            media.add(event.medium)
        session = getattr(request, "session_id", None) if request is not None else None
        self.recorder.stored(pages, parent.external if parent is not None else None, event, self._lora, session)

    def _known(self, kvplug_hash: int) -> Optional[_Page]:
        return self._pages.get(kvplug_hash) or self._recent.get(kvplug_hash)

    def _new_page(self, kvplug_hash: int, index: int, request: Any, hashes: Any, size: int) -> _Page:
        if hashes is not None and index < len(hashes):
            return _Page(maybe_convert_block_hash(hashes[index]), index, block_extra_keys(request, index, size))
        self.unmatched_pages += 1
        digest = hashlib.blake2b(repr(self.namespace).encode() + kvplug_hash.to_bytes(8, "little", signed=True),
                                 digest_size=8)
        return _Page(int.from_bytes(digest.digest(), "big"), index, None)

    # ------------------------------------------------------------------ removed
    def _removed(self, kvplug_hashes: Any, medium: str) -> None:
        gone = []
        for kvplug_hash in kvplug_hashes:
            page = self._release(kvplug_hash, medium)
            if page is not None:
                gone.append(page.external)
        self.recorder.removed(gone, medium)

    def _release(self, kvplug_hash: int, medium: str) -> Optional[_Page]:
        """The page's entry, no longer held in ``medium`` (forgotten once no medium holds it)."""
        page = self._pages.get(kvplug_hash)
        media = self._media.get(kvplug_hash)
        if page is None or media is None or medium not in media:
            return None
        media.discard(medium)
        if not media:
            del self._pages[kvplug_hash], self._media[kvplug_hash]
            self._recent[kvplug_hash] = page
        return page

    def settle(self) -> None:
        """A step ended: pages no medium holds are forgotten."""
        self._recent.clear()

    def forget(self, medium: Optional[str] = None) -> None:
        """Every page of this namespace is gone from ``medium`` (every medium: ``None``) without a
        removal event (a clear reports them all at once)."""
        for kvplug_hash in list(self._media):
            for held in list(self._media[kvplug_hash]) if medium is None else [medium]:
                page = self._release(kvplug_hash, held)
                if page is not None:
                    self.recorder.cleared(page.external, held)

    @property
    def pages(self) -> int:
        return len(self._pages)


class VLLMEventRecorder:
    """vLLM events of every namespace's cache, kept until ``take`` (one step's worth).

    Args:
        hash_block_size: the block size of the engine's ``request.block_hashes``
            (``BlockPool.hash_block_size``).
        spec: ``(kv_cache_spec_kind, kv_cache_spec_sliding_window)`` of the KV cache group, which
            vLLM's manager adds to its own ``BlockStored`` (``KVCacheManager.kv_cache_event_metadata``).
    """

    def __init__(self, hash_block_size: int, spec: tuple[Optional[str], Optional[int]] = (None, None)) -> None:
        self.hash_block_size = hash_block_size
        self.spec = spec
        self._events: list = []
        self._spaces: dict[Hashable, NamespaceEvents] = {}
        self._holders: Counter = Counter()  # (vLLM hash, kvplug medium) -> namespaces holding it

    def listener(self, namespace: Hashable) -> NamespaceEvents:
        """The listener of ``namespace``'s new cache (a namespace's earlier cache is gone: reset)."""
        old = self._spaces.get(namespace)
        if old is not None:
            old.forget()
        listener = self._spaces[namespace] = NamespaceEvents(self, namespace)
        return listener

    @property
    def unmatched_pages(self) -> int:
        return sum(space.unmatched_pages for space in self._spaces.values())

    # ------------------------------------------------------------------ from the namespaces
    def stored(self, pages: list, parent: Any, event: KvplugBlockStored, lora: _Lora, session: Optional[str]) -> None:
        """Publish ``event``'s pages (``(page, fresh)``: fresh unless the namespace held it on that
        medium already) that no namespace published on its medium yet, in runs of consecutive pages
        (each run chained to the page before it; ``parent``: the hash before the first page)."""
        run: list[int] = []
        for number, (page, fresh) in enumerate(pages):
            key = (page.external, event.medium)
            if fresh:
                self._holders[key] += 1
                if self._holders[key] == 1:
                    run.append(number)
                    continue
            self._emit_stored(pages, run, parent, event, lora, session)
            run = []
        self._emit_stored(pages, run, parent, event, lora, session)

    def _emit_stored(self, pages: list, run: list[int], parent: Any, event: KvplugBlockStored, lora: _Lora,
                     session: Optional[str]) -> None:
        if not run:
            return
        size = event.block_size
        first = run[0]
        parent_hash = pages[first - 1][0].external if first > 0 else parent
        chosen = [pages[number][0] for number in run]
        tokens = list(event.token_ids[first * size:(run[-1] + 1) * size])
        self._events.append(BlockStored(
            block_hashes=[page.external for page in chosen], parent_block_hash=parent_hash, token_ids=tokens,
            block_size=size, lora_id=lora.lora_id, medium=WIRE_MEDIUM.get(event.medium, event.medium),
            lora_name=lora.lora_name, extra_keys=to_event_extra_keys([page.extra_keys for page in chosen]),
            group_idx=_GROUP, kv_cache_spec_kind=self.spec[0], kv_cache_spec_sliding_window=self.spec[1],
            session_id=session,
        ))

    def removed(self, externals: list, medium: str) -> None:
        """Publish the removal of the hashes whose last holder on ``medium`` let them go."""
        gone = []
        for external in externals:
            key = (external, medium)
            self._holders[key] -= 1
            if self._holders[key] <= 0:
                del self._holders[key]
                gone.append(external)
        if gone:
            self._events.append(BlockRemoved(block_hashes=gone, medium=WIRE_MEDIUM.get(medium, medium),
                                             group_idx=_GROUP))

    def cleared(self, external: Any, medium: str) -> None:
        """A holder let ``external`` go on ``medium`` inside a clear (published as one clear)."""
        key = (external, medium)
        self._holders[key] -= 1
        if self._holders[key] <= 0:
            del self._holders[key]

    # ------------------------------------------------------------------ clears and taking
    def all_cleared(self) -> None:
        """Everything published is gone (a quarantine, a reset): one ``AllBlocksCleared``, replacing
        the step's events so far (a clear supersedes them; vLLM publishes its manager's events, its
        own clear among them, before the connector's, so nothing kvplug reports may follow it)."""
        self._events = [AllBlocksCleared()]

    def clear_all(self) -> None:
        """Every namespace's cache was replaced (a quarantine): forget what each published, clear once."""
        for space in self._spaces.values():
            space.forget()
        self.all_cleared()

    def take(self) -> list:
        for space in self._spaces.values():
            space.settle()
        events, self._events = self._events, []
        return events
