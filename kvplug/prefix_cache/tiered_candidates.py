"""The host tier's eviction candidates of the ``tiered_radix`` cache: unlocked host-resident leaves,
least recently used first.

The same lazy min-heap as ``radix_candidates.EvictionCandidates`` (see there), keyed by the
node's ``host_heap_seq`` so that a node's device-tier and host-tier memberships never mix.
"""

from __future__ import annotations

import itertools
from heapq import heapify, heappop, heappush
from typing import Iterable

from kvplug.prefix_cache.radix_node import RadixNode

_COMPACTION_SLACK = 64


class HostEvictionCandidates:
    """Unlocked host-resident leaves, ordered by ``(last_access, insertion order)``."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._next_seq = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, node: RadixNode) -> None:
        """Make ``node`` a candidate, or re-rank it after its ``last_access`` changed."""
        if node.host_heap_seq < 0:
            self._size += 1
        seq = next(self._next_seq)
        node.host_heap_seq = seq
        heappush(self._heap, (node.last_access, seq, node))
        self._compact_if_stale()

    def discard(self, node: RadixNode) -> None:
        if node.host_heap_seq >= 0:
            node.host_heap_seq = -1
            self._size -= 1
            self._compact_if_stale()

    def pop_least_recent(self) -> RadixNode:
        heap = self._heap
        while heap:
            _, seq, node = heappop(heap)
            if node.host_heap_seq == seq:
                node.host_heap_seq = -1
                self._size -= 1
                return node
        raise AssertionError("tiered radix cache: no host eviction candidate left")

    def clear(self) -> None:
        for _, _, node in self._heap:
            node.host_heap_seq = -1
        self._heap.clear()
        self._size = 0

    def _compact_if_stale(self) -> None:
        if len(self._heap) > 2 * self._size + _COMPACTION_SLACK:
            self._heap = [entry for entry in self._heap if entry[2].host_heap_seq == entry[1]]
            heapify(self._heap)

    def check(self, expected: Iterable[RadixNode]) -> None:
        """Assert the candidates are exactly ``expected``, each ranked by its current recency."""
        expected_ids = {id(node) for node in expected}
        live = {id(node): (ts, node) for ts, seq, node in self._heap if node.host_heap_seq == seq}
        assert self._size == len(expected_ids), (
            f"host candidate count {self._size} != number of unlocked host-resident leaves {len(expected_ids)}"
        )
        assert live.keys() == expected_ids, (
            f"host candidates differ from the unlocked host-resident leaves: {len(live.keys() - expected_ids)} "
            f"extra, {len(expected_ids - live.keys())} missing"
        )
        for ts, node in live.values():
            assert ts == node.last_access, f"stale host heap rank {ts} for {node!r}"
