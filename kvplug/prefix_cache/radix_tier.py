"""The policy a ``radix`` tree calls at the few points where a second tier changes what it does.

Why a policy and not a subclass: the tree (``radix``) owns every node, lock, size and eviction
candidate of both tiers; where a node's *bytes* live and move is the tier's business alone. So the
tree calls its tier at exactly these points and nowhere else: the start of an ``evict`` (the
tier hands it the ``WriteBacks`` it fills), a device leaf chosen by ``evict`` (keep it in host
memory, queuing its copy, or let the tree drop it), the end of an ``evict`` (the tier takes the
``WriteBacks`` back and issues the copies),
a split (a node's tier state is split with it), an insert whose path runs through host-resident
nodes (they take the caller's device locations), a node leaving the tree, ``reset`` and
``check_integrity``. A cache without a tier (plain ``radix``) has ``tier=None``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvplug.prefix_cache.radix_node import RadixNode
from kvplug.prefix_cache.write_backs import WriteBacks


class TierPolicy(ABC):
    """A second tier under the ``radix`` tree's device tier (``kvplug.prefix_cache.host_tier``)."""

    @abstractmethod
    def begin_evict(self) -> WriteBacks:
        """The start of one ``evict`` call: the empty queue of its copies, which that call owns
        and hands back to ``finish_evict`` (``DeferredWorkError`` if an earlier one never was)."""

    @abstractmethod
    def keep_evicted(self, leaf: RadixNode, write_backs: WriteBacks) -> bool:
        """``evict`` took ``leaf`` (device-resident, unlocked, every child host-resident) off the
        device tier's books: make it resident in this tier (``RadixPrefixCache.set_host_resident``),
        queue its copy in ``write_backs`` if its bytes must move, and return ``True``; or return
        ``False`` and the tree drops it with its subtree."""

    @abstractmethod
    def finish_evict(self, write_backs: WriteBacks) -> None:
        """The end of one ``evict`` call (also when it raised): take ``write_backs`` (from this
        call's ``begin_evict``) and issue its copies. ``DeferredWorkError`` if taken already."""

    @abstractmethod
    def on_split(self, upper: RadixNode, lower: RadixNode, at_bytes: int) -> None:
        """``lower`` was cut after ``at_bytes`` bytes; ``upper`` is the new node above it (both
        already hold their halves of ``key`` and ``value``): split this tier's state the same way."""

    @abstractmethod
    def adopt(self, node: RadixNode, head: RadixNode, device_locations: bytes) -> list[RadixNode]:
        """Make the host-resident nodes below ``head`` down to ``node`` device-resident at
        ``device_locations`` (int32 bytes, validated, in path order); returns those nodes."""

    @abstractmethod
    def on_drop(self, node: RadixNode) -> None:
        """``node`` leaves the tree (still linked to its parent): release what this tier holds for it."""

    @abstractmethod
    def reset(self) -> None:
        """The tree forgot everything (``reset``): so does this tier."""

    @abstractmethod
    def check_integrity(self, nodes: Sequence[RadixNode]) -> None:
        """Raise ``AssertionError`` if this tier's state disagrees with ``nodes`` (every node of the
        tree but the root)."""
