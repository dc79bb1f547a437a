"""``HostPagePins``: host pages a queued store write still reads, kept from reuse until it has.

Why: a store write (issue 30) may read its host pages on another thread (``store_writer``), after
the device -> host copy that fills them has landed, long after the serving thread moved on; the
node holding those pages may be dropped meanwhile and its pages handed to the next write-back or
store read. So a write's pages are *pinned*: ``pin`` returns a ``PinnedHostPages`` that the write
carries and releases once, from any thread, when it is done with them. The tier gives pages back
to its pool only through ``free``: a pinned page is *parked* there instead, and goes back to the
pool at the first ``reclaim`` after its pin was released. The tier calls ``reclaim`` at the one
place it takes pages (``HostTier.reserve_host_pages``), so a parked page is never reused early and
the pool's free list has one writer, the serving thread.

One owner: the tier holds a ``HostPagePins`` and only its thread calls it; a pin's ``release``
only appends the pin to a thread-safe queue that the next ``reclaim`` empties.
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from kvplug.interface import InvalidArgumentError

__all__ = ["HostPagePins", "PinnedHostPages"]


class PinnedHostPages:
    """Host pages one store write reads: not reused until ``release`` (see the module docstring).

    Attributes:
        pages: shape ``[n]``, int64, host page numbers, in the write's page order.
    """

    __slots__ = ("pages", "_released", "_queue")

    def __init__(self, pages: np.ndarray, queue: collections.deque) -> None:
        self.pages = pages
        self._released = False
        self._queue = queue

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """The write is done with the pages (written, dropped or failed); any thread, once (a
        second call does nothing)."""
        if not self._released:
            self._released = True
            self._queue.append(self)  # deque.append is atomic: the tier's next reclaim frees them


class HostPagePins:
    """The pinned and parked host pages of one host tier (one owner: the tier's thread)."""

    __slots__ = ("_pinned", "_parked", "_released")

    def __init__(self) -> None:
        self._pinned: dict[int, PinnedHostPages] = {}  # page -> its pin (a page is pinned once at a time)
        self._parked: set[int] = set()  # pinned pages the tier freed: back to the pool at reclaim
        self._released: collections.deque[PinnedHostPages] = collections.deque()

    @property
    def pinned_pages(self) -> int:
        """Pages pinned now (released pins count until the next ``reclaim``)."""
        return len(self._pinned)

    @property
    def parked_pages(self) -> np.ndarray:
        """Pages freed while pinned, held out of the pool: shape ``[p]``, int64, sorted."""
        return np.array(sorted(self._parked), dtype=np.int64)

    def is_pinned(self, page: int) -> bool:
        return int(page) in self._pinned

    def pin(self, pages: np.ndarray) -> PinnedHostPages:
        """Pin ``pages`` (shape ``[n]``, host page numbers held by a node) for one store write."""
        pages = np.asarray(pages, dtype=np.int64).copy()
        again = [int(page) for page in pages if int(page) in self._pinned]
        if again:
            raise InvalidArgumentError(
                f"expected host pages not pinned by another store write, got {len(again)} pinned already "
                f"(first: {again[0]}): a page is written to the store once per write-back"
            )
        pin = PinnedHostPages(pages, self._released)
        for page in pages:
            self._pinned[int(page)] = pin
        return pin

    def free(self, pool, pages: Sequence[int] | np.ndarray) -> None:
        """Give ``pages`` back to ``pool``, parking the pinned ones until their pin is released."""
        pinned = self._pinned
        if not pinned:  # the usual case: nothing queued for the store
            pool.release(pages)
            return
        unpinned = []
        for page in pages:
            page = int(page)
            if page in pinned:
                self._parked.add(page)
            else:
                unpinned.append(page)
        pool.release(unpinned)

    def reclaim(self, pool) -> None:
        """Unpin the pages of every pin released since the last call; parked ones go back to ``pool``."""
        released = self._released
        if not released:
            return
        freed = []
        while released:
            pin = released.popleft()
            for page in pin.pages:
                page = int(page)
                if self._pinned.get(page) is pin:
                    del self._pinned[page]
                    if page in self._parked:
                        self._parked.remove(page)
                        freed.append(page)
        pool.release(freed)

    def after_reset(self, pool) -> None:
        """``pool`` was just reset (every page free): take the pinned pages back out, parked."""
        if not self._pinned:
            return
        free = pool.take(pool.num_free_pages)
        pinned = np.isin(free, np.fromiter(self._pinned, dtype=np.int64))
        self._parked.update(int(page) for page in free[pinned])
        pool.release(free[~pinned])
