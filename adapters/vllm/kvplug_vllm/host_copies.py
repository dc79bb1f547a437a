"""The host tier's copies as the scheduler decides them, for the worker to make.

In vLLM the tiered radix tree (``kvplug.prefix_cache.tiered_radix``) runs in the scheduler process,
the KV blocks and the pinned host pages in the worker. ``RecordedHostPool`` is the tree's host
page pool on the scheduler side: it keeps the page bookkeeping (which host pages are free) and,
where ``HostKVPool`` would copy, records a ``HostCopy`` instead. The connector hands the recorded
copies to the worker in its metadata (``take``), in order: a write-back of blocks evicted in a step
runs before that step's forward (before vLLM writes the reused blocks), a load before the layers
read it. The worker side (``host_tier.WorkerHostTier``) applies them to the same page numbers.

No vLLM import.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from kvplug.interface import InvalidArgumentError, OutOfMemoryError

SAVE, LOAD = "save", "load"


class HostCopy(NamedTuple):
    """One copy for the worker: ``save`` blocks -> host pages, or ``load`` host pages -> blocks
    (``block_ids[i]`` <-> ``host_pages[i]``, every layer, K and V)."""

    kind: str
    block_ids: tuple[int, ...]
    host_pages: tuple[int, ...]


class RecordedHostPool:
    """Host page numbers of a tier whose bytes are in another process; copies are recorded.

    One pool is the host budget of every namespace; each namespace's tree uses its own
    ``share()``, the face ``HostTier`` uses of ``kvplug.memory.host_pool.HostKVPool``. Device
    locations are token locations ``block_id * page_size + i``.

    Args:
        num_pages: host pages (each one vLLM block of every layer).
        page_size: tokens per page (vLLM's block size).
        bytes_per_page: bytes of one page, all layers, K and V (for the tier's byte counters).
    """

    def __init__(self, num_pages: int, page_size: int, bytes_per_page: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise InvalidArgumentError(f"a host pool needs pages and a page size, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.bytes_per_page = bytes_per_page
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: pop() is the lowest page
        self._copies: list[HostCopy] = []

    def share(self) -> "HostPoolShare":
        return HostPoolShare(self)

    def record(self, kind: str, device_locations: np.ndarray | torch.Tensor, host_pages: np.ndarray) -> None:
        locations = np.asarray(device_locations.cpu() if isinstance(device_locations, torch.Tensor)
                               else device_locations).astype(np.int64)
        pages = np.asarray(host_pages, dtype=np.int64)
        if locations.size != pages.size * self.page_size:
            raise InvalidArgumentError(
                f"{pages.size} host pages need {pages.size * self.page_size} device locations, got {locations.size}")
        starts = locations[:: self.page_size]
        if np.any(starts % self.page_size):
            raise InvalidArgumentError("the host tier copies whole vLLM blocks; a page starts inside a block")
        self._copies.append(HostCopy(kind, tuple((starts // self.page_size).tolist()), tuple(pages.tolist())))

    def take_copies(self) -> tuple[HostCopy, ...]:
        """The copies recorded since the last call, in order (the connector ships them to the worker)."""
        copies, self._copies = tuple(self._copies), []
        return copies

    @property
    def num_free_pages(self) -> int:
        return len(self.free)


class HostPoolShare:
    """One namespace's use of a ``RecordedHostPool``: the pages it holds; ``HostKVPool``'s face."""

    device = torch.device("cpu")
    read_seconds = 0.0  # the copies run in the worker: not timed here
    write_seconds = 0.0

    def __init__(self, pool: RecordedHostPool) -> None:
        self._pool = pool
        self.num_pages = pool.num_pages
        self.page_size = pool.page_size
        self.bytes_per_page = pool.bytes_per_page
        self._held: set[int] = set()

    @property
    def num_free_pages(self) -> int:
        return len(self._pool.free)

    def take(self, count: int) -> np.ndarray:
        free = self._pool.free
        if count > len(free):
            raise OutOfMemoryError(f"the host KV tier has {len(free)} free pages, {count} were asked")
        if count == 0:
            return np.empty(0, dtype=np.int64)
        taken = free[-count:]
        del free[-count:]
        self._held.update(taken)
        return np.array(taken[::-1], dtype=np.int64)

    def release(self, pages: Sequence[int] | np.ndarray) -> None:
        pages = [int(page) for page in pages]
        self._held.difference_update(pages)
        self._pool.free.extend(reversed(pages))

    def reset(self) -> None:
        """This namespace forgot everything: its pages go back (other namespaces keep theirs)."""
        self._pool.free.extend(sorted(self._held, reverse=True))
        self._held.clear()

    def free_pages(self) -> np.ndarray:
        """Pages this namespace may not hold (free, or another namespace's): its integrity check's view."""
        held = self._held
        return np.array([page for page in range(self.num_pages) if page not in held], dtype=np.int64)

    def synchronize(self) -> None:
        return None

    def write(self, device_locations: np.ndarray | torch.Tensor, host_pages: np.ndarray) -> None:
        self._pool.record(SAVE, device_locations, host_pages)

    def read(self, host_pages: np.ndarray, device_locations: np.ndarray | torch.Tensor, *, wait: bool = True):
        self._pool.record(LOAD, device_locations, host_pages)
        return None  # the worker makes it before the step's forward: nothing to wait on here
