"""``DeferredFrees``: the pages given back inside one lazy-free region, released at its end.

Why an object: a scheduling step that finishes requests (``KVBackend.lazy_free``) must not hand
their pages out again within that step, so their frees wait until the step ends. That wait belongs
to the region, so the region owns it: ``FreeList.lazy`` opens one ``DeferredFrees`` (nested
regions share it), the frees made inside go into it, and ``FreeList.apply`` releases it once, when
the outermost region exits (also on an exception: the frees were real). Releasing it twice would
put the same pages on the free list twice, so a second ``apply`` raises ``DeferredWorkError``.
"""

from __future__ import annotations

import numpy as np

from kvplug.interface import DeferredWorkError

__all__ = ["DeferredFrees"]

_NO_PAGES = np.zeros(0, dtype=np.int32)


class DeferredFrees:
    """Pages freed inside one lazy region, not takeable until the region's ``FreeList.apply``.

    One owner: the outermost ``FreeList.lazy`` region that opened it. Each batch of pages is
    shape ``[n]``, int32, host (first token locations of whole pages), copied when added.
    """

    __slots__ = ("_batches", "_num_pages", "_taken")

    def __init__(self) -> None:
        self._batches: list[np.ndarray] = []
        self._num_pages = 0
        self._taken = False

    @property
    def num_pages(self) -> int:
        """Pages freed so far."""
        return self._num_pages

    @property
    def taken(self) -> bool:
        return self._taken

    def add(self, page_starts: np.ndarray) -> None:
        """Defer the free of ``page_starts`` (shape ``[n]``, int32, host; the caller may reuse it)."""
        if self._taken:
            raise DeferredWorkError(
                f"expected an open lazy region, got frees already released ({self._num_pages} pages): "
                f"{page_starts.size} pages freed now would never reach the free list"
            )
        self._batches.append(np.array(page_starts, dtype=np.int32))
        self._num_pages += int(page_starts.shape[0])

    def pages(self) -> np.ndarray:
        """A copy of the deferred pages: shape ``[num_pages]``, int32, host."""
        return np.concatenate(self._batches) if self._batches else _NO_PAGES.copy()

    def take(self) -> list[np.ndarray]:
        """The deferred batches, for the free list to append; the object is taken after."""
        if self._taken:
            raise DeferredWorkError(
                f"expected frees not yet released, got ones released already ({self._num_pages} pages): "
                "releasing them again would put the same pages on the free list twice"
            )
        self._taken = True
        return self._batches
