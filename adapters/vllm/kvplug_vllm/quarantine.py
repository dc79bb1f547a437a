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

With ``on_cache_failure: "fail"`` (``settings``) there is no hand-over: the fault is recorded and
raised (``stop``) out of vLLM's scheduler, which is what vLLM does with any scheduler exception:
EngineCore logs "EngineCore encountered a fatal error", tells the API server its engine is dead
(the request's answer is an error, ``/health`` is vLLM's 503) and exits; ``vllm serve`` then stops
on its own (unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH``). Every later call into the cache raises
the same stop (``check_running``), for an in-process engine that is driven again.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Sequence

from kvplug.cache_guard import LAST_RESORT, check_policy
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
        policy: ``"fallback"`` (quarantine, ``naive`` takes over) or ``"fail"`` (``stop``).

    Attributes:
        failures: faults met (each one quarantined the caches in use then, or stopped them).
        last_fault: the message of the latest fault, ``None`` before any.
        stopped: the error raised for the fault that stopped the cache (policy ``"fail"``), else ``None``.
    """

    def __init__(self, name: str, build_fallback: Callable[[], BasePrefixCache], policy: str = "fallback") -> None:
        self.name = name
        self._build_fallback = build_fallback
        self.policy = check_policy(policy)
        self.failures = 0
        self.last_fault: Optional[str] = None
        self.stopped: Optional[PrefixCacheFault] = None
        self._locked: dict[int, int] = {}  # block id -> locks of quarantined matches not released yet

    @property
    def tripped(self) -> bool:
        """True once a fault quarantined the plugin: every namespace uses the fallback."""
        return self.failures > 0

    def fallback(self) -> BasePrefixCache:
        return self._build_fallback()

    def record(self, fault: PrefixCacheFault, during: str) -> None:
        """Count ``fault``; under policy ``"fail"`` raise the stop (``stop``) instead of a hand-over."""
        self.failures += 1
        self.last_fault = str(fault)
        if self.policy == "fail":
            self.stop(fault, during)

    def stop(self, fault: PrefixCacheFault, during: str) -> None:
        """Raise the error that stops vLLM's engine (see the module docstring), naming the plugin,
        the call and the option that chose it; later calls raise it again (``check_running``)."""
        self.stopped = PrefixCacheFault(
            f"kvplug prefix cache {self.name!r} failed in {during} and the engine stops "
            f"(on_cache_failure='fail' in kv_connector_extra_config): {fault}",
            plugin=fault.plugin or self.name, method=fault.method)
        logger.error("%s", self.stopped)
        raise self.stopped from fault

    def check_running(self) -> None:
        """Raise the stop again once policy ``"fail"`` met a fault."""
        if self.stopped is not None:
            raise self.stopped

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
        ``CacheGuard.as_dict`` the vLLM host has, and the plugin that was quarantined (none when
        policy ``"fail"`` stopped it instead)."""
        return {
            "on_cache_failure": self.policy,
            "cache_failures": self.failures,
            "last_cache_fault": self.last_fault,
            "quarantined_prefix_cache": self.name if self.tripped and self.stopped is None else None,
            "stopped": self.stopped is not None,
        }
