"""A prefix-cache plugin that faults inside SGLang is quarantined; SGLang's scheduler keeps serving.

The SGLang host builds untrusted prefix caches (``trusted`` False) inside a
``kvplug.prefix_cache.checked.CheckedPrefixCache``, so a plugin that raises or answers outside the
contract raises ``PrefixCacheFault`` before the adapter used the answer. ``KvplugPrefixCache``
catches it around each call it makes into a cache and, by ``--kvplug-on-cache-failure``:

- ``fallback`` (default): every namespace's checked cache is handed over (``hand_over``) to a new
  ``naive`` cache (trusted: it cannot fault) and the call runs again on it. From then on new
  namespaces get ``naive`` too.
- ``fail``: the fault is logged and raised, with the plugin, the SGLang call and what the plugin
  did; SGLang's scheduler stops on it (and the server with it).

The hand-over asks the faulty cache nothing: the checked wrapper knows every page the plugin
holds and how many locks each has (``CheckedPrefixCache.held_pages``). All of them go into a
``kvplug.prefix_cache.inherited.InheritedPrefixes`` in front of the new cache, with the same lock
counts. The unlocked ones are evictable at once (the layer evicts them first, so SGLang's next
eviction hands them back to ``token_to_kv_pool_allocator``; ``evictable_size`` counts them from the
hand-over on). The locked ones are running requests' prefixes: SGLang still reads their K/V
through the nodes it holds (``req.last_node``, ``req.lock``), so they stay until the last of those
locks is released. Freeing the unlocked pages at once instead would be unsafe: a request matched
in this scheduling pass but not yet locked (SGLang locks at admission, after matching every
waiting request) and a request checkpointing when the fault came both use pages the cache holds
unlocked.

Nodes the faulty cache issued stay valid: ``Inherited.handle_for`` turns a quarantined handle into a
handle of the layer over the same pages, so SGLang's later ``dec_lock_ref`` / ``unlock`` (and a
``lock`` of a node matched before the fault) reach the layer; a request's next checkpoint inserts
into the layer, which keeps a prefix that starts with an inherited page as inherited pages.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np
import torch

from kvplug.interface import BasePrefixCache, InvalidArgumentError, PrefixCacheFault
from kvplug.prefix_cache.checked import CheckedHandle, CheckedPrefixCache
from kvplug.prefix_cache.inherited import InheritedHandle, InheritedPrefixes

from kvplug_sglang import names

logger = logging.getLogger(__name__)

FALLBACK = "naive"


class Inherited:
    """One namespace's hand-over: the layer that took the faulty cache's pages, and which of those
    pages it still holds (cleared as they are evicted), so a quarantined handle is honoured only
    while its pages are there.

    Attributes:
        layer: the ``InheritedPrefixes`` that is the namespace's cache now.
        old: the quarantined cache; its handles are the stale ones.
    """

    def __init__(self, layer: InheritedPrefixes, old: CheckedPrefixCache, pages: np.ndarray) -> None:
        self.layer = layer
        self.old = old
        self._still_held = np.zeros(old.num_pages, dtype=bool)
        self._still_held[pages] = True

    def is_stale(self, handle: object) -> bool:
        return isinstance(handle, CheckedHandle) and handle.owner is self.old

    def handle_for(self, handle: CheckedHandle) -> InheritedHandle:
        """The layer's handle over a quarantined handle's pages (the same locations)."""
        pages = handle.pages
        if pages.size and not self._still_held[pages].all():
            raise InvalidArgumentError(
                f"a node of the quarantined prefix cache {self.old.name!r} ({handle.cached_len} tokens) was used "
                "after its pages were evicted (it was neither locked nor used before the eviction)"
            )
        return InheritedHandle(self.layer, handle.get_matched_indices().cpu().to(torch.int32), pages)

    def evicted(self, locations: torch.Tensor) -> None:
        """``locations`` (shape ``[n]``, any int dtype, any device) left the layer."""
        if locations.numel():
            pages = locations.reshape(-1, self.layer.page_size)[:, 0].cpu().numpy().astype(np.int64)
            self._still_held[pages // self.layer.page_size] = False

    def forget(self) -> None:
        """The layer was reset: no quarantined handle is valid any more."""
        self._still_held[:] = False


def hand_over(old: CheckedPrefixCache, new: BasePrefixCache) -> tuple[Inherited, int, int]:
    """Put every page ``old`` holds, with its lock count, into an ``InheritedPrefixes`` in front of
    ``new`` (empty). Returns ``(the record, pages now evictable, pages locked by running requests)``."""
    pages, locks = old.held_pages()
    size = old.page_size
    layer = InheritedPrefixes(new, num_pages=old.num_pages, page_size=size)
    offsets = np.arange(size, dtype=np.int64)

    def handle(subset: np.ndarray) -> InheritedHandle:
        indices = torch.from_numpy((subset[:, None] * size + offsets).reshape(-1).astype(np.int32))
        return InheritedHandle(layer, indices, subset)

    if pages.size:
        layer.inherit(handle(pages).get_matched_indices())  # held, each page locked once
        unlocked = pages[locks == 0]
        if unlocked.size:
            layer.lock_handle(handle(unlocked), unlock=True)
        for count in range(2, int(locks.max()) + 1):
            more = pages[locks >= count]
            layer.lock_handle(handle(more))
    locked = int(np.count_nonzero(locks))
    return Inherited(layer, old, pages), int(pages.size) - locked, locked


class CacheQuarantine:
    """The policy and record of prefix-cache faults of one SGLang tree cache.

    Args:
        name: the plugin's registered name.
        policy: ``"fallback"`` or ``"fail"`` (``--kvplug-on-cache-failure``).
        build_fallback: builds one empty ``naive`` cache (trusted) for the pool's page size.

    Attributes:
        failures: faults met.
        last_fault: the message of the latest fault, ``None`` before any.
    """

    def __init__(self, name: str, policy: str, build_fallback: Callable[[], BasePrefixCache]) -> None:
        if policy not in names.ON_CACHE_FAILURE_CHOICES:
            raise InvalidArgumentError(
                f"on_cache_failure must be one of {list(names.ON_CACHE_FAILURE_CHOICES)}, got {policy!r}"
            )
        self.name = name
        self.policy = policy
        self._build_fallback = build_fallback
        self.failures = 0
        self.last_fault: Optional[str] = None

    @property
    def tripped(self) -> bool:
        """True once a fault quarantined the plugin: new namespaces get the fallback."""
        return self.failures > 0 and self.policy == "fallback"

    def fallback(self) -> BasePrefixCache:
        return self._build_fallback()

    def as_dict(self) -> dict:
        """For SGLang's ``/server_info`` (``internal_states[rank]["kvplug_prefix_cache"]``): the
        keys of ``kvplug serve``'s ``CacheGuard.as_dict``, and the plugin that was quarantined."""
        return {
            "prefix_cache": FALLBACK if self.tripped else self.name,
            "cache_failures": self.failures,
            "last_cache_fault": self.last_fault,
            "on_cache_failure": self.policy,
            "stopped": self.failures > 0 and self.policy == "fail",
            "quarantined_prefix_cache": self.name if self.tripped else None,
        }

    def record(self, fault: PrefixCacheFault, during: str) -> None:
        """Count ``fault``; under ``fail``, log it and raise it with SGLang's call named."""
        self.failures += 1
        self.last_fault = str(fault)
        if self.policy == "fail":
            message = (
                f"kvplug prefix cache {self.name!r} failed in {_call(during)} and the scheduler stops "
                f"(--kvplug-on-cache-failure fail): {fault}"
            )
            logger.error("%s", message)
            raise PrefixCacheFault(message, plugin=fault.plugin, method=fault.method) from fault

    def replaced(self, fault: PrefixCacheFault, during: str, evictable: int, locked: int) -> None:
        logger.warning(
            "kvplug prefix cache %r failed in %s (%s): quarantined; %d of its pages are evictable "
            "now (back to SGLang's allocator on the next eviction), %d pages of running requests' locked "
            "prefixes are kept until they finish; prefix cache %r takes over",
            self.name, _call(during), fault, evictable, locked, FALLBACK,
        )


def _call(during: str) -> str:
    """``"SGLang's match_prefix"`` for an SGLang API name, else ``during`` as it is."""
    return f"SGLang's {during}" if during.isidentifier() else during
