"""The eviction candidates of the ``radix`` cache: unlocked leaves, least recently used first.

Kept incrementally as lazy entries ``(last_access, seq, node)``. A node's live entry is the one
whose ``seq`` equals ``node.heap_seq`` (or the slot the set was built over: the tree's
host-resident leaves use ``host_heap_seq``); older entries of the same node (before a refresh) and
entries of nodes that stopped being candidates are skipped when popped. Membership is therefore
exact (``heap_seq >= 0``) and O(1) to change.

Why a queue beside the heap: the clock only moves forward, and most entries are pushed with the
newest tick (a new leaf, a touched path), so they arrive in order. Those go to the back of a sorted
``deque`` (O(1) in, O(1) out); only the rest (a parent that became a leaf, an unlocked node keeping
its old tick) go to a min-heap. The least recent candidate is the smaller of the two fronts, so an
LRU eviction pops mostly from the queue and never sifts through a heap of every leaf. Stale entries
are dropped in one O(entries) pass once they outnumber live ones, which keeps both within
``2 * candidates + slack`` entries at amortised O(1) cost per push.
"""

from __future__ import annotations

import itertools
from collections import deque
from heapq import heapify, heappop, heappush
from operator import attrgetter
from typing import Iterable

from kvplug.prefix_cache.radix_node import RadixNode

_COMPACTION_SLACK = 64  # small sets are never worth compacting


class EvictionCandidates:
    """Unlocked leaves of one tree, ordered by ``(last_access, insertion order)``.

    Args:
        seq_field: the ``RadixNode`` slot that holds the node's live entry number here:
            ``heap_seq`` for the device tier; the tree keeps a second set over
            ``host_heap_seq`` (its host-resident leaves), so a node's memberships never mix.
        label: names the set in assertion messages.
    """

    def __init__(self, seq_field: str = "heap_seq", label: str = "leaves") -> None:
        self._queue: deque[tuple[int, int, RadixNode]] = deque()  # sorted: pushed in order
        self._heap: list[tuple[int, int, RadixNode]] = []  # pushed out of order
        self._next_seq = itertools.count()
        self._size = 0
        # bound accessors: one C call each, where getattr(node, name) would look the name up per call
        self._seq_of = attrgetter(seq_field)
        self._seq_field = seq_field
        self._label = label

    def __len__(self) -> int:
        return self._size

    @property
    def heap_entries(self) -> int:
        """Entries held, live and stale, queue and heap (for tests and integrity checks)."""
        return len(self._queue) + len(self._heap)

    def add(self, node: RadixNode) -> None:
        """Make ``node`` a candidate, or re-rank it after its ``last_access`` changed."""
        if self._seq_of(node) < 0:
            self.add_new(node)
            return
        self._size -= 1  # add_new counts it again
        self.add_new(node)  # its old entry goes stale
        if len(self._queue) + len(self._heap) > 2 * self._size + _COMPACTION_SLACK:
            self._drop_stale_entries()

    def add_new(self, node: RadixNode) -> None:
        """``add`` for a node known not to be a candidate (a new leaf, a parent that became one).
        One live entry more and no stale one: the bound on stale entries still holds."""
        self._size += 1
        seq = next(self._next_seq)
        setattr(node, self._seq_field, seq)
        queue = self._queue
        last_access = node.last_access
        if not queue or queue[-1][0] <= last_access:  # ties: seq grows, so the queue stays sorted
            queue.append((last_access, seq, node))
        else:
            heappush(self._heap, (last_access, seq, node))

    def add_newest(self, node: RadixNode) -> None:
        """``add_new`` for a node stamped with the clock's newest tick (a new leaf): its entry
        goes to the back of the queue, no comparison."""
        self._size += 1
        seq = next(self._next_seq)
        setattr(node, self._seq_field, seq)
        self._queue.append((node.last_access, seq, node))

    def discard(self, node: RadixNode) -> None:
        """``node`` is no longer a candidate (locked, got a child, or evicted); its entry goes stale."""
        if self._seq_of(node) >= 0:
            setattr(node, self._seq_field, -1)
            self._size -= 1
            if len(self._queue) + len(self._heap) > 2 * self._size + _COMPACTION_SLACK:
                self._drop_stale_entries()

    def pop_least_recent(self) -> RadixNode:
        """Remove and return the least recently used candidate."""
        queue, heap, seq_of = self._queue, self._heap, self._seq_of
        while queue or heap:
            if heap and (not queue or heap[0] < queue[0]):
                _, seq, node = heappop(heap)
            else:
                _, seq, node = queue.popleft()
            if seq_of(node) == seq:
                setattr(node, self._seq_field, -1)
                self._size -= 1
                if len(queue) + len(heap) > 2 * self._size + _COMPACTION_SLACK:
                    self._drop_stale_entries()
                return node
        raise AssertionError(f"radix cache: no eviction candidate left among unlocked {self._label} "
                             "although evictable tokens remain")

    def clear(self) -> None:
        for entries in (self._queue, self._heap):
            for _, _, node in entries:
                setattr(node, self._seq_field, -1)
        self._queue.clear()
        self._heap.clear()
        self._size = 0

    def _drop_stale_entries(self) -> None:
        seq_of = self._seq_of
        self._queue = deque(entry for entry in self._queue if seq_of(entry[2]) == entry[1])
        self._heap = [entry for entry in self._heap if seq_of(entry[2]) == entry[1]]
        heapify(self._heap)

    def check(self, expected: Iterable[RadixNode]) -> None:
        """Assert the candidates are exactly ``expected``, each has a live, up-to-date entry, and
        the queue is sorted."""
        expected_ids = {id(node) for node in expected}
        seq_of, label = self._seq_of, self._label
        entries = [*self._queue, *self._heap]
        live = {id(node): (ts, node) for ts, seq, node in entries if seq_of(node) == seq}
        assert self._size == len(expected_ids), (
            f"candidate count {self._size} != number of unlocked {label} {len(expected_ids)}"
        )
        assert live.keys() == expected_ids, (
            f"candidate set differs from the unlocked {label}: {len(live.keys() - expected_ids)} extra, "
            f"{len(expected_ids - live.keys())} missing"
        )
        for ts, node in live.values():
            assert ts == node.last_access, f"stale heap rank {ts} for {node!r}"
        ranks = [entry[:2] for entry in self._queue]
        assert ranks == sorted(ranks), f"the in-order queue of the {label} is out of order"
        assert len(entries) <= 2 * self._size + _COMPACTION_SLACK, (
            f"{len(entries)} entries held for {self._size} candidates: stale entries are not dropped"
        )
