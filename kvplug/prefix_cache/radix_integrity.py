"""``check_integrity`` of the ``radix`` cache: one full walk that re-derives every invariant.

Slow on purpose (it visits every node); tests and debugging call it, hot paths never do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvplug.prefix_cache.radix_keys import BYTES_PER_TOKEN, as_int32
from kvplug.prefix_cache.radix_node import RadixNode

if TYPE_CHECKING:
    from kvplug.prefix_cache.radix import RadixPrefixCache


def check_radix_tree(cache: RadixPrefixCache) -> None:
    """Raise ``AssertionError`` naming the first broken invariant of ``cache``'s tree.

    Checked: root shape; every edge a non-empty page multiple with as many locations as token
    ids (int32); handle lengths (``cached_len``) and generations; parent/child links and
    first-page child keys; lock counts (never negative; a node counts its own locks plus its
    children's); recency (a parent is never older than a child, nothing is newer than the clock);
    no location held twice; evictable/protected sizes; the eviction candidates are exactly the
    unlocked leaves, each ranked by its current recency.
    """
    root = cache._root
    page_size = cache.page_size
    page_bytes = cache._page_bytes
    assert root.parent is None and root.key == b"" and root.value == b"", "root must be an empty edge"
    assert root.lock_ref == 0 and root.heap_seq < 0, "the root is never locked nor an eviction candidate"
    assert root.cached_len == 0 and root.generation is cache._generation, "the root must start the current tree"

    evictable = protected = 0
    unlocked_leaves: list[RadixNode] = []
    locations: list[bytes] = []
    stack = [root]
    while stack:
        node = stack.pop()
        child_locks = 0
        for first_page, child in node.children.items():
            _check_edge(child, node, node is root, first_page, page_size, page_bytes, cache._clock)
            child_locks += child.lock_ref
            stack.append(child)
        if node is root:
            continue
        assert node.own_locks >= 0, f"{node!r}: negative count of its own locks"
        assert node.lock_ref == node.own_locks + child_locks, (
            f"{node!r}: lock_ref {node.lock_ref} != its own locks {node.own_locks} + its children's lock counts "
            f"{child_locks}"
        )
        locations.append(node.value)
        if node.lock_ref:
            protected += node.num_tokens
        else:
            evictable += node.num_tokens
            if not node.children:
                unlocked_leaves.append(node)

    assert (evictable, protected) == (cache._evictable, cache._protected), (
        f"size_info says evictable={cache._evictable} protected={cache._protected}, "
        f"the tree holds evictable={evictable} protected={protected}"
    )
    if locations:
        every_location = as_int32(b"".join(locations))
        assert np.unique(every_location).shape[0] == every_location.shape[0], "a location is cached twice"
    cache._candidates.check(unlocked_leaves)


def _check_edge(
    child: RadixNode,
    parent: RadixNode,
    parent_is_root: bool,
    first_page: bytes,
    page_size: int,
    page_bytes: int,
    clock: int,
) -> None:
    assert child.parent is parent, f"{child!r} does not point back at its parent"
    assert child.generation is parent.generation, f"{child!r} belongs to another tree"
    assert isinstance(child.key, bytes) and isinstance(child.value, bytes), f"{child!r}: key/value must be bytes"
    num_tokens = len(child.value) // BYTES_PER_TOKEN
    assert num_tokens > 0 and num_tokens % page_size == 0 and len(child.value) % BYTES_PER_TOKEN == 0, (
        f"{child!r}: edge of {len(child.value)} bytes is not a positive multiple of the page size {page_size}"
    )
    assert len(child.key) == len(child.value), (
        f"{child!r}: {len(child.key) // BYTES_PER_TOKEN} token ids for {num_tokens} locations"
    )
    assert child.key[:page_bytes] == first_page, f"{child!r} is filed under another first page"
    assert child.cached_len == parent.cached_len + num_tokens, f"{child!r} does not end where its path ends"
    assert child.lock_ref >= 0, f"{child!r}: negative lock count"
    assert child.last_access <= clock, f"{child!r}: recency {child.last_access} is ahead of the clock {clock}"
    if not parent_is_root:
        assert parent.last_access >= child.last_access, f"{parent!r} is older than its child {child!r}"
