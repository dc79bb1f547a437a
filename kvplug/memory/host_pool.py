"""The host-memory tier's page pool: KV pages copied out of the device KV pool, page-contiguous.

Layout: one tensor ``[num_host_pages, 2, num_layers, page_size, local_kv_heads, head_dim]`` (pinned
on a CUDA host, so copies are DMA; an ordinary CPU tensor when the KV pool is on the CPU). One host
page holds a device page's K and V for *every* layer contiguously, so moving a node of ``n`` pages
is a gather of all its layers into one contiguous device staging buffer and then as many big
copies as the host pages form contiguous runs (usually one) -- not ``2 * num_layers`` small copies
per page. Host token location ``h * page_size + i`` is token ``i`` of host page ``h`` (the same
convention as the device pool's locations), which is what the tiered cache keeps in its nodes.

The free list is a stack of host pages: taking pops the lowest-numbered end, releasing pushes the
pages back so the next take returns them in the same order, which keeps runs contiguous.

Streams (CUDA). Every transfer over PCIe/NVLink-C2C runs on one side stream, the *copy stream*;
the gathers and scatters that touch the KV pool run on the current (compute) stream.

- ``write`` (device -> host): the gather into staging is queued on the compute stream, so stream
  order makes it read the pages before any later kernel can overwrite them and the caller may
  hand the device pages out again at once; the copy of staging to host memory is handed to a
  worker thread (``paced_copies``) that issues it on the copy stream after the gather, one
  16 MiB chunk at a time: while the copy engine is kept fed, every other device -> host copy
  (a step's sampled ids) waits for all of it (figures in BENCHMARKS.md).
- ``read`` (host -> device): first every queued write of the pages it reads is issued (usually
  none is left: those pages were written long before); then the copy stream copies host pages
  into a device staging buffer and a third stream, the *load stream*, scatters staging into the
  destination pages once the compute stream has finished what was queued on it when ``read`` was
  called (earlier users of those pages: the write-back gather of the pages it was just handed).
  ``read(wait=True)`` makes the compute stream wait for the scatter, so everything queued after it
  (the prefill that reads the pages) sees the loaded bytes; ``read(wait=False)`` returns the
  scatter's event instead, and the compute stream runs on while the load copies (the caller
  orders the event before the first forward that reads the pages). Staging is a ring of two
  ``STAGING_BYTES`` buffers allocated once (a copy into a buffer waits for the scatter out of it):
  loads queued back to back then need 128 MiB, not their whole size, of device memory.
- Host pages are only ever touched by the copy stream, in the order the copies were issued (the
  worker issues writes in submission order, and a read waits until the writes of its pages are
  issued), so a host page released by one copy and taken by the next is never read and written
  out of order.
- CPU access (the shared KV store, issue 30): a store writer reads host pages once the write that
  filled them is complete (``write`` returns its ticket, ``wait_written`` waits for it, off the
  serving thread); a store read fills free host pages from the CPU only when no copy that is not
  complete touches them (``pages_busy``, which never blocks).
"""

from __future__ import annotations

import collections
import time
from typing import Sequence

import numpy as np
import torch

from kvplug.interface import InvalidArgumentError, OutOfMemoryError, TierCopyError
from kvplug.memory.host_tier_size import check_host_tier_fits
from kvplug.memory.paced_copies import PacedHostCopies

#: Largest device staging buffer of one copy: big copies run at full DMA speed from a few MiB on,
#: and the pool usually leaves the device little spare memory.
STAGING_BYTES = 64 << 20


class HostKVPool:
    """Pages of KV in host memory, each holding all layers of one device page.

    Args:
        kv_buffer: the device pool, shape ``[2, num_layers, num_pages + 1, page_size, local_kv_heads,
            head_dim]`` (``MHAKVPool.kv_buffer``); read and written through token locations.
        num_pages: host pages to allocate (``>= 1``).
        pin: pin the host memory; default: when ``kv_buffer`` is on CUDA.

    Attributes:
        buffer: shape ``[num_pages, 2, num_layers, page_size, local_kv_heads, head_dim]``, host.
        bytes_per_page: bytes of one host page (= one device page, all layers, K and V).
    """

    def __init__(self, kv_buffer: torch.Tensor, num_pages: int, *, pin: bool | None = None) -> None:
        if not isinstance(kv_buffer, torch.Tensor) or kv_buffer.dim() != 6 or kv_buffer.shape[0] != 2:
            raise InvalidArgumentError(
                "the host tier needs the KV pool's buffer of shape [2, num_layers, num_pages + 1, page_size, "
                f"local_kv_heads, head_dim], got {getattr(kv_buffer, 'shape', kv_buffer)!r}"
            )
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise InvalidArgumentError(f"the host pool needs at least one page, got num_pages={num_pages!r}")
        _, num_layers, device_pages, page_size, heads, head_dim = kv_buffer.shape
        self.num_pages = num_pages
        self.page_size = int(page_size)
        self.device = kv_buffer.device
        self._is_cuda = self.device.type == "cuda"
        self._page_shape = (2, num_layers, page_size, heads, head_dim)
        # the device pool by page, page first (a view): [num_pages + 1, 2, L, P, H, D / w], its rows
        # read as w-element words (``_as_words``): the page gathers and scatters move 8-byte words
        self._by_page = _as_words(kv_buffer).permute(2, 0, 1, 3, 4, 5)
        # the device pool by token location: [2, L, (num_pages + 1) * page_size, H, D]
        self._device_tokens = kv_buffer.view(2, num_layers, device_pages * page_size, heads, head_dim)
        pin = self._is_cuda if pin is None else pin
        self._registered = False
        check_host_tier_fits(num_pages * self._page_bytes(kv_buffer))  # issue 32: before it is granted, not at first touch
        try:
            self.buffer = torch.empty((num_pages, *self._page_shape), dtype=kv_buffer.dtype)
            if pin:
                self._pin(self.buffer)
        except (RuntimeError, MemoryError) as error:
            raise OutOfMemoryError(
                f"cannot allocate the host KV tier: {num_pages:,} pages of "
                f"{self._page_bytes(kv_buffer):,} bytes{' (pinned)' if pin else ''}: "
                f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            ) from error
        self._buffer_words = _as_words(self.buffer)
        self.bytes_per_page = self._page_bytes(kv_buffer)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: pop() is the lowest page
        self._copy_stream = torch.cuda.Stream(self.device) if self._is_cuda else None
        self._load_stream = torch.cuda.Stream(self.device) if self._is_cuda else None
        self._ring: list[torch.Tensor] = []  # staging of loads (CUDA), allocated at the first load
        self._ring_free: list[torch.cuda.Event | None] = [None, None]  # scatter out of each buffer done
        self._ring_next = 0
        self._writes = PacedHostCopies(self._copy_stream) if self._is_cuda else None
        # loads' copies out of host pages, oldest first, maybe not done (one stream: they end in order)
        self._reads: collections.deque[tuple[torch.cuda.Event, np.ndarray]] = collections.deque()
        self.write_seconds = 0.0
        self.read_seconds = 0.0

    def _pin(self, buffer: torch.Tensor) -> None:
        """Page-lock ``buffer`` in place with ``cudaHostRegister`` (the DMA engines then copy it at
        full speed). Not ``pin_memory=True``: torch's pinned allocator rounds every block up to a
        power of two, which for a 40 GiB tier would lock 64 GiB of host memory."""
        code = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister of {buffer.numel() * buffer.element_size():,} bytes failed: {code}")
        self._registered = True

    @property
    def pinned(self) -> bool:
        """Whether the host pages are page-locked (registered with CUDA)."""
        return self._registered

    def __del__(self) -> None:
        if getattr(self, "_registered", False):
            try:
                self._writes.close()  # issues what is queued and waits for it
                self._copy_stream.synchronize()  # no copy may still be using the pages
                torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            except Exception:  # interpreter shutdown: CUDA may already be gone
                pass
            self._registered = False

    def _page_bytes(self, kv_buffer: torch.Tensor) -> int:
        return int(np.prod(self._page_shape)) * kv_buffer.element_size()

    # ------------------------------------------------------------------ pages
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def take(self, count: int) -> np.ndarray:
        """Remove ``count`` free pages: shape ``[count]``, int64, host. ``OutOfMemoryError`` (nothing
        taken) when fewer are free."""
        if count > len(self._free):
            raise OutOfMemoryError(f"the host KV tier has {len(self._free)} free pages, {count} were asked")
        if count == 0:
            return np.empty(0, dtype=np.int64)
        taken = self._free[-count:]
        del self._free[-count:]
        return np.array(taken[::-1], dtype=np.int64)

    def release(self, pages: Sequence[int] | np.ndarray) -> None:
        """Give pages back (host page numbers); the next ``take`` returns them in this order."""
        self._free.extend(int(page) for page in reversed(list(pages)))

    def reset(self) -> None:
        """Every page free again (the cache forgot everything)."""
        self._free = list(range(self.num_pages - 1, -1, -1))

    def free_pages(self) -> np.ndarray:
        """The free pages (for integrity checks): shape ``[f]``, int64, host."""
        return np.array(self._free, dtype=np.int64)

    # ------------------------------------------------------------------ copies
    def synchronize(self) -> None:
        """Wait until every copy made so far has completed (issued by the worker and done)."""
        if self._is_cuda:
            self._writes.issue_through()
            self._copy_stream.synchronize()
            self._load_stream.synchronize()

    def wait_written(self, ticket: int | None) -> None:
        """Block until the ``write`` that returned ``ticket`` has landed in host memory (at once
        for ``None``: a pool on the CPU). Never on the serving thread: it waits for the device.
        ``TierCopyError`` when the copy failed (its host pages hold no trustworthy bytes)."""
        if ticket is None:
            return
        try:
            self._writes.wait_complete(ticket)
        except RuntimeError as error:
            raise TierCopyError(f"the device -> host copy {ticket} failed: {error}") from error

    def pages_busy(self, host_pages: np.ndarray) -> bool:
        """Whether a copy not yet complete writes or reads any of ``host_pages`` (so the CPU must
        not write them now); never blocks. Always ``False`` on the CPU (copies are done on return)."""
        if not self._is_cuda:
            return False
        host_pages = np.asarray(host_pages, dtype=np.int64)
        self._forget_finished_reads()
        if any(np.intersect1d(pages, host_pages).size for _, pages in self._reads):
            return True
        return self._writes.pages_busy(host_pages)

    def write(self, device_locations: np.ndarray | torch.Tensor, host_pages: np.ndarray) -> int | None:
        """Copy device KV to host pages: token ``j`` of ``device_locations`` goes to token
        ``j % page_size`` of host page ``host_pages[j // page_size]``, for every layer, K and V.

        Args:
            device_locations: shape ``[len(host_pages) * page_size]``, integers; token locations of
                the device pool. A host array of whole pages (what a page-granular cache holds) is
                gathered page by page; anything else (a device tensor, partial pages) token by token.
            host_pages: shape ``[m]``, int64, host.

        Returns the copy's ticket for ``wait_written`` (CUDA: the copy is still under way), or
        ``None`` when it is done (a pool on the CPU).

        Raises ``TierCopyError`` when a copy fails (the host pages' contents are then undefined).
        """
        started = time.perf_counter()
        try:
            return self._write(device_locations, host_pages)
        except Exception as error:
            raise TierCopyError(f"device -> host copy of {len(host_pages)} pages failed: {error}") from error
        finally:
            self.write_seconds += time.perf_counter() - started

    def read(self, host_pages: np.ndarray, device_locations: np.ndarray | torch.Tensor, *, wait: bool = True):
        """Copy host pages back into the device pool at ``device_locations`` (the layout and the
        argument forms of ``write``).

        Args:
            wait: order the copy before everything queued on the current stream from now on
                (CUDA); with ``False`` the current stream runs on and the caller orders the
                returned event before reading the pages.

        Returns ``None`` when the copy is already ordered (``wait``, or a pool on the CPU, where it
        is done), else a ``torch.cuda.Event`` recorded after it.

        Raises ``TierCopyError`` when a copy fails (the destination locations are then undefined;
        the host pages are unchanged).
        """
        started = time.perf_counter()
        try:
            done = self._read(host_pages, device_locations)
            if done is not None and wait:
                torch.cuda.current_stream(self.device).wait_event(done)
                return None
            return done
        except Exception as error:
            raise TierCopyError(f"host -> device copy of {len(host_pages)} pages failed: {error}") from error
        finally:
            self.read_seconds += time.perf_counter() - started

    def _chunks(self, count: int) -> list[tuple[int, int]]:
        """``[begin, end)`` page ranges of at most ``STAGING_BYTES`` each."""
        step = max(1, STAGING_BYTES // self.bytes_per_page)
        return [(begin, min(begin + step, count)) for begin in range(0, count, step)]

    def _device_index(self, locations: np.ndarray | torch.Tensor, *, pinned: bool = False) -> tuple[torch.Tensor, int]:
        """``locations`` as an index of the device pool: ``(device page numbers [m], 1)`` for a host
        array of whole pages, else ``(token locations [m * P], page_size)``; int64, on the device."""
        size = self.page_size
        if isinstance(locations, np.ndarray):
            locations = locations.astype(np.int64, copy=False)
            pages = locations[::size] // size
            if size == 1 or np.array_equal(locations, (pages[:, None] * size + np.arange(size)).reshape(-1)):
                return self._upload(pages, pinned), 1
            return self._upload(locations, pinned), size
        return locations.to(self.device, non_blocking=True).long(), size

    def _upload(self, values: np.ndarray, pinned: bool) -> torch.Tensor:
        """``values`` on the device, queued on the current stream; ``pinned`` (CUDA): through
        pinned memory (torch's pinned allocator keeps the block until the copy is done).

        A load's index goes pinned: from pageable memory an upload first waits for everything
        queued on its stream, which holds the scheduler until the loads before it are done. A
        write-back's index goes pageable, on the compute stream: pinned, the 0 %-hit run
        (write-backs only) was 6 % slower on the H200 (3.70 vs 3.49 s, 3 repeats each; 1.00x
        with pageable uploads in the same benchmark before); why was not established."""
        tensor = torch.from_numpy(values)
        if pinned and self._is_cuda:
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _write(self, device_locations: np.ndarray | torch.Tensor, host_pages: np.ndarray) -> int | None:
        index, per_page = self._device_index(device_locations)
        ticket = None
        for begin, end in self._chunks(len(host_pages)):
            ticket = self._write_chunk(index[begin * per_page : end * per_page], per_page == 1, host_pages[begin:end])
        return ticket

    def _write_chunk(self, index: torch.Tensor, by_page: bool, host_pages: np.ndarray) -> int | None:
        """Copy one chunk; the ticket of its last queued copy (CUDA), else ``None`` (done)."""
        count = len(host_pages)
        two, layers, page_size, heads, head_dim = self._page_shape
        if by_page and not self._is_cuda:  # gather each run of pages straight into the host pages
            offset = 0
            for first, length in _runs(host_pages):
                torch.index_select(self._by_page, 0, index[offset : offset + length],
                                   out=self._buffer_words[first : first + length])
                offset += length
            return None
        # one gather of every layer's pages (or rows) into page-contiguous staging [m, 2, L, P, H, D]
        if by_page:
            staging = torch.index_select(self._by_page, 0, index).view(self.buffer.dtype)
        else:
            gathered = self._device_tokens.index_select(2, index).view(two, layers, count, page_size, heads, head_dim)
            staging = gathered.permute(2, 0, 1, 3, 4, 5).contiguous()
        if not self._is_cuda:
            self._copy_runs(host_pages, staging, to_host=True)
            return None
        gathered = torch.cuda.Event()
        gathered.record(torch.cuda.current_stream(self.device))
        offset = 0
        ticket = None
        for first, length in _runs(host_pages):  # the worker keeps staging alive until copied
            ticket = self._writes.submit(self.buffer[first : first + length], staging[offset : offset + length],
                                         gathered, np.arange(first, first + length, dtype=np.int64))
            offset += length
        return ticket

    def _copy_runs(self, host_pages: np.ndarray, staging: torch.Tensor, *, to_host: bool) -> None:
        """Copy between ``staging`` (``[m, 2, L, P, H, D]``) and the host pages, one copy per run
        of consecutive pages, on the current stream (CUDA: host -> device only)."""
        offset = 0
        for first, length in _runs(host_pages):
            if to_host:
                self.buffer[first : first + length].copy_(staging[offset : offset + length], non_blocking=self._is_cuda)
            else:
                staging[offset : offset + length].copy_(self.buffer[first : first + length], non_blocking=True)
            offset += length

    def _read(self, host_pages: np.ndarray, device_locations: np.ndarray | torch.Tensor) -> torch.cuda.Event | None:
        if not self._is_cuda:
            index, per_page = self._device_index(device_locations)
            for begin, end in self._chunks(len(host_pages)):
                self._read_chunk_cpu(host_pages[begin:end], index[begin * per_page : end * per_page], per_page == 1)
            return None
        self._writes.issue_through_pages(host_pages)  # the writes of these pages go first
        compute, copy_stream, load_stream = torch.cuda.current_stream(self.device), self._copy_stream, self._load_stream
        if not self._ring:
            ring_bytes = max(STAGING_BYTES, self.bytes_per_page)  # a chunk is at least one page
            self._ring = [torch.empty(ring_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        load_stream.wait_stream(compute)  # the pages' earlier users, and a location tensor made there
        if isinstance(device_locations, torch.Tensor) and device_locations.is_cuda:
            device_locations.record_stream(load_stream)  # read there after the caller may have dropped it
        with torch.cuda.stream(load_stream):
            index, per_page = self._device_index(device_locations, pinned=True)
        for begin, end in self._chunks(len(host_pages)):
            slot = self._ring_next
            self._ring_next = 1 - slot
            count = end - begin
            staging = self._ring[slot][: count * self.bytes_per_page].view(self.buffer.dtype).view(count, *self._page_shape)
            with torch.cuda.stream(copy_stream):  # after every earlier copy of host pages
                if self._ring_free[slot] is not None:
                    copy_stream.wait_event(self._ring_free[slot])
                self._copy_runs(host_pages[begin:end], staging, to_host=False)
                copied = torch.cuda.Event()
                copied.record(copy_stream)
            self._forget_finished_reads()
            self._reads.append((copied, host_pages[begin:end]))
            load_stream.wait_event(copied)
            with torch.cuda.stream(load_stream):
                self._scatter(staging, index[begin * per_page : end * per_page], per_page == 1)
                scattered = torch.cuda.Event()
                scattered.record(load_stream)
            self._ring_free[slot] = scattered
        return scattered

    def _forget_finished_reads(self) -> None:
        reads = self._reads
        while reads and reads[0][0].query():  # a query, never a wait
            reads.popleft()

    def _read_chunk_cpu(self, host_pages: np.ndarray, index: torch.Tensor, by_page: bool) -> None:
        if by_page:  # scatter each run of host pages straight into the pool
            offset = 0
            for first, length in _runs(host_pages):
                self._by_page.index_copy_(0, index[offset : offset + length], self._buffer_words[first : first + length])
                offset += length
            return
        self._scatter(self.buffer[torch.from_numpy(np.ascontiguousarray(host_pages))], index, by_page)

    def _scatter(self, staging: torch.Tensor, index: torch.Tensor, by_page: bool) -> None:
        """Write ``staging`` (``[m, 2, L, P, H, D]``) into the device pool at ``index`` (``m`` page
        numbers, or ``m * P`` token locations), on the current stream."""
        if by_page:
            self._by_page.index_copy_(0, index, _as_words(staging))
            return
        two, layers, page_size, heads, head_dim = self._page_shape
        rows = staging.permute(1, 2, 0, 3, 4, 5).reshape(two, layers, staging.shape[0] * page_size, heads, head_dim)
        self._device_tokens.index_copy_(2, index, rows)


def _as_words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (last dimension contiguous) viewed as the widest integer words its rows divide
    into: wide words gather a page several times faster than 2-byte elements
    (``benchmarks/page_gather_speed.py``), and the gather and the scatter of a load run on the
    compute stream, in the way of the model's kernels."""
    row_bytes = tensor.shape[-1] * tensor.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0 and dtype.itemsize >= tensor.element_size():
            return tensor.view(dtype)
    return tensor


def _runs(pages: np.ndarray) -> list[tuple[int, int]]:
    """``pages`` as runs of consecutive page numbers, in order: ``[(first, length), ...]``."""
    pages = np.asarray(pages, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [pages.size]))
    return [(int(pages[start]), int(end - start)) for start, end in zip(starts, ends)]
