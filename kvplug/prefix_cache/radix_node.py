"""Tree nodes of the ``radix`` prefix cache; a node is also the handle of the prefix ending with it.

A node holds one edge of the radix tree: a run of whole pages of token ids (``key``) and the KV
locations of those tokens (``value``), both int32 ``bytes`` on the host (see ``radix_keys``).
Handing out the node itself as the handle costs nothing per call and stays correct across splits:
a split inserts the new node *above* the existing one, so a node keeps ending at ``cached_len``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvplug.interface import BaseCacheHandle, InvalidArgumentError
from kvplug.prefix_cache.radix_keys import BYTES_PER_TOKEN

if TYPE_CHECKING:
    from kvplug.prefix_cache.radix import RadixPrefixCache


class RadixGeneration:
    """One tree of one cache. ``reset()`` starts a new generation, which is how a handle from
    before the reset (or from another cache) is told apart from a live one."""

    __slots__ = ("cache",)

    def __init__(self, cache: RadixPrefixCache) -> None:
        self.cache = cache


class RadixNode(BaseCacheHandle):
    """One edge of the tree, and the handle of the prefix that ends with it.

    Attributes:
        cached_len: tokens from the root to the end of this edge (the handle's length).
        parent: the node above, ``None`` for the root and for a node that was evicted.
        children: child nodes keyed by the bytes of their first page.
        key: token ids of this edge, int32 bytes, cpu; a positive whole number of pages.
        first_page: ``key``'s first page, the very ``bytes`` object that files the node in its parent's
            ``children`` (``b""`` for the root): unlinking the node takes no slice of ``key`` and no hash.
        value: KV locations of those tokens, int32 bytes, cpu; as long as ``key``.
        lock_ref: number of locked handles whose path runs through this node.
        own_locks: number of those locks taken on this node itself (its own handle); an unlock is
            refused when there is none, so a prefix of a locked handle cannot be unlocked in its place.
        last_access: logical clock of the last match/insert whose path ran through this node.
        heap_seq: sequence number of this node's live entry in the eviction candidates, or -1
            when the node is not a candidate (locked, internal, root or evicted).
        generation: the tree this node belongs to.
        page_hashes: the KV-event hash of each page of the edge (``block_hashes``), computed when
            events are first reported for the node; ``None`` until then.
        on_host: ``value`` holds host-tier locations (only with a host tier, ``host_tier``).
        host_children: how many of ``children`` are host-resident (0 without a host tier): a
            device node is an eviction candidate when every child is host-resident.
        host_heap_seq: like ``heap_seq``, for the host-resident leaves' candidates.
        host_copy: host-tier locations of a copy of a device-resident node's K/V (kept after a
            load, so evicting the node again needs no write-back), or ``None``.
    """

    __slots__ = (
        "cached_len",
        "parent",
        "children",
        "key",
        "first_page",
        "value",
        "lock_ref",
        "own_locks",
        "last_access",
        "heap_seq",
        "generation",
        "page_hashes",
        "on_host",
        "host_children",
        "host_heap_seq",
        "host_copy",
    )

    def __init__(
        self,
        generation: RadixGeneration,
        parent: RadixNode | None,
        key: bytes,
        value: bytes,
        cached_len: int,
        last_access: int = 0,
        first_page: bytes = b"",
    ) -> None:
        self.cached_len = cached_len
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.key = key
        self.first_page = first_page
        self.value = value
        self.lock_ref = 0
        self.own_locks = 0
        self.last_access = last_access
        self.heap_seq = -1
        self.generation = generation
        self.page_hashes: tuple[int, ...] | None = None
        self.on_host = False
        self.host_children = 0
        self.host_heap_seq = -1
        self.host_copy: bytes | None = None

    def get_matched_indices(self) -> torch.Tensor:
        """Token locations of the prefix: shape ``[cached_len]``, int32, on the cache's device.

        A fresh tensor on every call, built from the tree's host copy (and copied to the device).
        """
        return self.generation.cache.path_indices(self)

    @property
    def num_tokens(self) -> int:
        return len(self.value) // BYTES_PER_TOKEN

    def __repr__(self) -> str:
        return (
            f"RadixNode(cached_len={self.cached_len}, tokens={self.num_tokens}, children={len(self.children)}, "
            f"lock_ref={self.lock_ref}, own_locks={self.own_locks}, last_access={self.last_access})"
        )


def stale_handle_error(what: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"expected a live handle of this radix cache, got one whose prefix {what}; "
        "lock a handle right after match_prefix and before any evict()"
    )
