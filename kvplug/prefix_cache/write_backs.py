"""``WriteBacks``: the device -> host copies one ``evict`` of a tiered ``radix`` tree queues.

Why an object and not a list inside the tier: an ``evict`` moves several leaves to host memory,
and their copies are issued together at its end (one gather, few copies). The queue belongs to
that one call, so it is an object the call gets (``TierPolicy.begin_evict``), fills
(``keep_evicted``) and hands back (``finish_evict``), and nothing outlives it: the tier holds no
queue of its own between two calls. Taking it twice would copy pages the evict already freed
(another request may have written them since), so a second take raises ``DeferredWorkError``;
so does the next ``begin_evict`` when one was dropped without being taken.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvplug.interface import DeferredWorkError
from kvplug.prefix_cache.radix_node import RadixNode

__all__ = ["WriteBack", "WriteBacks"]


class WriteBack(NamedTuple):
    """One evicted node's bytes to copy from the device tier to the host tier.

    Attributes:
        node: the node, host-resident since the ``evict`` that queued this copy.
        device_locations: its device token locations, as the node held them before the evict:
            int32 bytes (host data), whole pages of ``page_size``; the pages the evict frees.
        host_pages: shape ``[len(device_locations) // (4 * page_size)]``, int64, host; the host
            pages they are copied into, page for page.
    """

    node: RadixNode
    device_locations: bytes
    host_pages: np.ndarray


class WriteBacks:
    """The write-backs one ``evict`` queued, taken once by the call that issues their copies.

    One owner: the ``evict`` call that got it from ``TierPolicy.begin_evict``. ``add`` queues a
    copy; ``take`` returns the copies still to make and marks the object taken. An entry whose
    node left the tree after it was queued (dropped later in the same evict to make host room;
    its host pages may belong to another node by then) is not returned: that copy is not made.
    """

    __slots__ = ("_entries", "_taken")

    def __init__(self) -> None:
        self._entries: list[WriteBack] = []
        self._taken = False

    def __len__(self) -> int:
        """Copies queued so far (dropped nodes' included)."""
        return len(self._entries)

    @property
    def taken(self) -> bool:
        return self._taken

    def add(self, node: RadixNode, device_locations: bytes, host_pages: np.ndarray) -> None:
        """Queue ``node``'s copy (see ``WriteBack`` for the arguments)."""
        if self._taken:
            raise DeferredWorkError(
                f"expected write-backs not yet taken, got ones already taken ({len(self._entries)} copies issued): "
                "a write-back queued now would never be copied"
            )
        self._entries.append(WriteBack(node, device_locations, host_pages))

    def take(self) -> tuple[WriteBack, ...]:
        """The copies to make now, in the order they were queued; the object is taken after."""
        if self._taken:
            raise DeferredWorkError(
                f"expected write-backs not yet taken, got ones already taken ({len(self._entries)} copies): "
                "their device pages were freed by the evict that queued them, so they are copied once"
            )
        self._taken = True
        return tuple(entry for entry in self._entries if entry.node.parent is not None)
