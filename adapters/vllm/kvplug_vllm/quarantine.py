"""A prefix-cache plugin that faults inside vLLM's scheduler is quarantined; the engine keeps serving.

``connector.prefix_cache_factory`` builds an untrusted plugin (``trusted`` False) inside kvplug's
``CheckedPrefixCache``, so a plugin that raises or answers outside the contract raises
``PrefixCacheFault`` before ``block_cache.BlockPrefixCache`` used the answer. That class catches it
around each call it makes into a cache (``BlockPrefixCache._guarded``), hands every namespace's
checked cache over (``BlockQuarantine.hand_over``), builds the fallback (``naive``, trusted: it
cannot fault) for every namespace from then on, and runs the call again on it.

The hand-over asks the faulty cache nothing: the checked wrapper knows every block the plugin
locks (``CheckedPrefixCache.held_pages``), and ``BlockPrefixCache`` knows the blocks it took a
reference on for it (``CacheSpace.blocks``: a fault after the plugin took an insert, in its size
check, leaves pages the plugin holds that kvplug never referenced). Unlike the SGLang host
(where the cache's lock is the only thing keeping a page), vLLM counts references per block, and
each block a request uses carries that request's reference. So kvplug's own reference is simply
dropped (``drop_refs``) on every unlocked block: a block no request uses reaches vLLM's free queue,
one a request still uses stays with it. A locked block keeps kvplug's reference until the matches
locked before the fault are unlocked (``unlock``): a request admitted with a hit locks it before
vLLM takes its own reference (``prefix_caching.RequestPrefixes.admit``), so dropping it at once
could free a block vLLM is about to adopt. Every lookup answered by the faulty cache is stale
after the hand-over (the cache's ``epoch`` moves), so waiting requests look up again and miss:
outputs stay vLLM's, only the hits are lost.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Sequence

from kvplug.cache_guard import LAST_RESORT
from kvplug.interface import BasePrefixCache, PrefixCacheFault
from kvplug.prefix_cache.checked import CheckedHandle, CheckedPrefixCache

logger = logging.getLogger(__name__)

BlockRefs = Callable[[Sequence[int]], None]


class BlockQuarantine:
    """The record of prefix-cache faults of one ``BlockPrefixCache``, and the blocks still locked
    by matches of the quarantined cache.

    Args:
        name: the plugin's registered name.
        build_fallback: builds one empty trusted cache (``naive``) with the blocks' page size.

    Attributes:
        failures: faults met (each one quarantined the caches in use then).
        last_fault: the message of the latest fault, ``None`` before any.
    """

    def __init__(self, name: str, build_fallback: Callable[[], BasePrefixCache]) -> None:
        self.name = name
        self._build_fallback = build_fallback
        self.failures = 0
        self.last_fault: Optional[str] = None
        self._locked: dict[int, int] = {}  # block id -> locks of quarantined matches not released yet

    @property
    def tripped(self) -> bool:
        """True once a fault quarantined the plugin: every namespace uses the fallback."""
        return self.failures > 0

    def fallback(self) -> BasePrefixCache:
        return self._build_fallback()

    def record(self, fault: PrefixCacheFault, during: str) -> None:
        self.failures += 1
        self.last_fault = str(fault)

    def hand_over(self, old: CheckedPrefixCache, blocks: Iterable[int], drop_refs: BlockRefs) -> tuple[int, int]:
        """Take ``blocks`` (those kvplug references for ``old``) back from ``old`` (see the module
        docstring). Returns ``(blocks whose kvplug reference was dropped, blocks kept for locks of
        old matches)``."""
        pages, locks = old.held_pages()
        counts = dict(zip(pages.tolist(), locks.tolist()))
        unlocked, kept = [], 0
        for block in sorted(blocks):
            count = counts.get(block, 0)
            if count:
                self._locked[block] = count
                kept += 1
            else:
                unlocked.append(block)
        if unlocked:
            drop_refs(unlocked)
        return len(unlocked), kept

    def replaced(self, fault: PrefixCacheFault, during: str, dropped: int, kept: int) -> None:
        logger.warning(
            "kvplug prefix cache %r failed in %s (%s): quarantined; kvplug dropped its reference on %d blocks, "
            "%d blocks locked by running requests are kept until they release them; prefix cache %r takes over",
            self.name, during, fault, dropped, kept, LAST_RESORT,
        )

    def unlock(self, handle: CheckedHandle, drop_refs: BlockRefs) -> None:
        """A handle of the quarantined cache, locked before the fault, is unlocked: blocks no such
        handle locks any more lose kvplug's reference."""
        released = []
        for block in handle.pages.tolist():
            count = self._locked.get(block, 0)
            if count <= 0:
                raise AssertionError(f"block {block} unlocked more often than quarantined matches locked it")
            if count == 1:
                del self._locked[block]
                released.append(block)
            else:
                self._locked[block] = count - 1
        if released:
            drop_refs(released)

    @property
    def locked_blocks(self) -> int:
        """Blocks kvplug still references for locks of quarantined matches."""
        return len(self._locked)

    def as_dict(self) -> dict[str, Any]:
        """For the connector's snapshot (``/kvplug/stats``): the keys of ``kvplug serve``'s
        ``CacheGuard.as_dict`` the vLLM host has, and the plugin that was quarantined."""
        return {
            "cache_failures": self.failures,
            "last_cache_fault": self.last_fault,
            "quarantined_prefix_cache": self.name if self.tripped else None,
        }
