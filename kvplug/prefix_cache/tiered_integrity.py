"""``check_integrity`` of the tiered radix cache: one full walk re-deriving every invariant of both tiers.

Slow on purpose (it visits every node); tests and debugging call it, hot paths never do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvplug.prefix_cache.radix_integrity import _check_edge
from kvplug.prefix_cache.radix_keys import as_int32
from kvplug.prefix_cache.radix_node import RadixNode

if TYPE_CHECKING:
    from kvplug.prefix_cache.tiered_radix import TieredRadixPrefixCache


def check_tiered_radix_tree(cache: "TieredRadixPrefixCache") -> None:
    """Raise ``AssertionError`` naming the first broken invariant of ``cache``.

    Checked, besides the ``radix`` edge invariants (``radix_integrity``): below a host-resident
    node everything is host-resident; per tier, evictable/protected sizes and no location held
    twice; host locations are whole host pages, each page held by one node (as its host-resident
    value or as a device-resident node's host copy) or free in the host pool, never both (host
    conservation: held + free == host pages); host copies only on device-resident nodes, as long as
    their value, and exactly the nodes the cache lists as having one; no write-back left queued;
    the device candidates are exactly the unlocked device nodes whose children are all
    host-resident, the host candidates exactly the unlocked host-resident leaves.
    """
    root = cache._root
    page_size = cache.page_size
    assert root.parent is None and root.key == b"" and root.value == b"" and not root.on_host, "root must be an empty device edge"
    assert root.lock_ref == 0 and root.heap_seq < 0 and root.host_heap_seq < 0, "the root is never locked nor a candidate"
    assert root.generation is cache._generation, "the root must start the current tree"
    assert not cache._pending, f"{len(cache._pending)} write-back(s) queued outside evict()"

    sizes = {False: [0, 0], True: [0, 0]}  # on_host -> [evictable, protected]
    device_candidates: list[RadixNode] = []
    host_candidates: list[RadixNode] = []
    locations: dict[bool, list[bytes]] = {False: [], True: []}
    copies: list[RadixNode] = []
    stack = [root]
    while stack:
        node = stack.pop()
        child_locks = 0
        for first_page, child in node.children.items():
            _check_edge(child, node, node is root, first_page, page_size, cache._page_bytes, cache._clock)
            assert not node.on_host or child.on_host, f"{child!r} is device-resident below host-resident {node!r}"
            child_locks += child.lock_ref
            stack.append(child)
        if node is root:
            continue
        assert node.own_locks >= 0, f"{node!r}: negative count of its own locks"
        assert node.lock_ref == node.own_locks + child_locks, (
            f"{node!r}: lock_ref {node.lock_ref} != own locks {node.own_locks} + children's {child_locks}"
        )
        locations[node.on_host].append(node.value)
        if node.host_copy is not None:
            assert not node.on_host, f"{node!r} is host-resident and has a host copy"
            assert len(node.host_copy) == len(node.value), f"{node!r}: its host copy is not as long as its value"
            copies.append(node)
            locations[True].append(node.host_copy)
        sizes[node.on_host][1 if node.lock_ref else 0] += node.num_tokens
        if node.lock_ref == 0:
            if node.on_host and not node.children:
                host_candidates.append(node)
            elif not node.on_host and all(child.on_host for child in node.children.values()):
                device_candidates.append(node)

    assert sizes[False] == [cache._evictable, cache._protected], (
        f"size_info says evictable={cache._evictable} protected={cache._protected}, the device tier holds "
        f"evictable={sizes[False][0]} protected={sizes[False][1]}"
    )
    assert sizes[True] == [cache._host_evictable, cache._host_protected], (
        f"host_size_info says evictable={cache._host_evictable} protected={cache._host_protected}, the host "
        f"tier holds evictable={sizes[True][0]} protected={sizes[True][1]}"
    )
    if locations[False]:
        device = as_int32(b"".join(locations[False]))
        assert np.unique(device).size == device.size, "a device location is cached twice"
    pool = cache.host_pool
    if pool is None:
        assert not locations[True], "host-resident nodes without a host pool"
    else:
        host = as_int32(b"".join(locations[True])).astype(np.int64)
        pages = host[::page_size] // page_size
        expected = (np.repeat(pages, page_size) * page_size + np.tile(np.arange(page_size), pages.size))
        assert np.array_equal(host, expected), "a host-resident node's (or host copy's) locations are not whole host pages"
        free = pool.free_pages()
        held_and_free = np.concatenate([pages, free])
        assert np.unique(held_and_free).size == held_and_free.size, "a host page is held twice (or held and free)"
        assert held_and_free.size == pool.num_pages, (
            f"host conservation broken: {pages.size} held + {free.size} free != {pool.num_pages} host pages"
        )
        assert held_and_free.size == 0 or (held_and_free.min() >= 0 and held_and_free.max() < pool.num_pages), (
            "a host page number lies outside the host pool"
        )
    assert set(copies) == set(cache._copies) and len(copies) == len(cache._copies), (
        f"{len(copies)} nodes hold a host copy, the cache lists {len(cache._copies)}"
    )
    copy_tokens = sum(node.num_tokens for node in copies)
    assert copy_tokens == cache._host_copy_tokens, (
        f"the cache counts {cache._host_copy_tokens} host-copy tokens, its host copies hold {copy_tokens}"
    )
    cache._candidates.check(device_candidates)
    cache._host_candidates.check(host_candidates)
