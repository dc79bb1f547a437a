"""The eviction candidates of the ``radix`` cache: unlocked leaves, least recently used first.

Kept incrementally as a lazy min-heap of ``(last_access, seq, node)``. A node's live entry is the
one whose ``seq`` equals ``node.heap_seq``; older entries of the same node (before a refresh) and
entries of nodes that stopped being candidates are skipped when popped. Membership is therefore
exact (``heap_seq >= 0``) and O(1) to change, and ``evict`` pops only what it evicts plus stale
entries. Stale entries are dropped in one O(heap) pass once they outnumber live ones, which keeps
the heap within ``2 * candidates + slack`` entries at amortised O(1) cost per push.
"""

from __future__ import annotations

import itertools
from heapq import heapify, heappop, heappush
from typing import Iterable

from kvplug.prefix_cache.radix_node import RadixNode

_COMPACTION_SLACK = 64  # small heaps are never worth compacting


class EvictionCandidates:
    """Unlocked leaves of one tree, ordered by ``(last_access, insertion order)``."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._next_seq = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def heap_entries(self) -> int:
        """Entries in the heap, live and stale (for tests and integrity checks)."""
        return len(self._heap)

    def add(self, node: RadixNode) -> None:
        """Make ``node`` a candidate, or re-rank it after its ``last_access`` changed."""
        if node.heap_seq < 0:
            self._size += 1
        seq = next(self._next_seq)
        node.heap_seq = seq
        heappush(self._heap, (node.last_access, seq, node))
        if len(self._heap) > 2 * self._size + _COMPACTION_SLACK:
            self._drop_stale_entries()

    def discard(self, node: RadixNode) -> None:
        """``node`` is no longer a candidate (locked, got a child, or evicted); its entry goes stale."""
        if node.heap_seq >= 0:
            node.heap_seq = -1
            self._size -= 1
            if len(self._heap) > 2 * self._size + _COMPACTION_SLACK:
                self._drop_stale_entries()

    def pop_least_recent(self) -> RadixNode:
        """Remove and return the least recently used candidate."""
        heap = self._heap
        while heap:
            _, seq, node = heappop(heap)
            if node.heap_seq == seq:
                node.heap_seq = -1
                self._size -= 1
                if len(self._heap) > 2 * self._size + _COMPACTION_SLACK:
                    self._drop_stale_entries()
                return node
        raise AssertionError("radix cache: no eviction candidate left although evictable tokens remain")

    def clear(self) -> None:
        for _, _, node in self._heap:
            node.heap_seq = -1
        self._heap.clear()
        self._size = 0

    def _drop_stale_entries(self) -> None:
        self._heap = [entry for entry in self._heap if entry[2].heap_seq == entry[1]]
        heapify(self._heap)

    def check(self, expected: Iterable[RadixNode]) -> None:
        """Assert the candidates are exactly ``expected`` and each has a live, up-to-date entry."""
        expected_ids = {id(node) for node in expected}
        live = {id(node): (ts, node) for ts, seq, node in self._heap if node.heap_seq == seq}
        assert self._size == len(expected_ids), (
            f"candidate count {self._size} != number of unlocked leaves {len(expected_ids)}"
        )
        assert live.keys() == expected_ids, (
            f"candidate set differs from the unlocked leaves: {len(live.keys() - expected_ids)} extra, "
            f"{len(expected_ids - live.keys())} missing"
        )
        for ts, node in live.values():
            assert ts == node.last_access, f"stale heap rank {ts} for {node!r}"
        assert len(self._heap) <= 2 * self._size + _COMPACTION_SLACK, (
            f"heap holds {len(self._heap)} entries for {self._size} candidates: stale entries are not dropped"
        )
