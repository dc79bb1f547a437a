"""What a host can read about a ``KVBackend``: its parts, sizes, statistics and integrity.

``KVBackendView`` holds the parts ``create_backend`` built and the lifetime counters;
``KVBackend`` (``kvplug.backend``) adds the request lifecycle that changes them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvplug.attention.decode_staging import DecodeStager, DecodeUpload
from kvplug.backend_factory import BackendParts
from kvplug.backend_stats import BackendStats
from kvplug.memory.deferred_appends import DeferredAppend
from kvplug.memory.request import Request


class StagedStep(NamedTuple):
    """The last decode ``prepare`` on GPU tables, for that step's ``input_ids`` and ``append_tokens``.

    Attributes:
        rows: the ``states.batch_rows`` array it staged (its identity names the request list).
        upload: the ``DecodeUpload`` (batch, indices, input ids, host device lengths).
        chain_call: its call number when an allocate of every known token of these requests
            came right before (so ``device_len == num_tokens == cached_len + 1``), else -1.
        device_lens: shape ``[bs]``, int64, host; the requests' device lengths.
    """

    rows: np.ndarray
    upload: DecodeUpload
    chain_call: int
    device_lens: np.ndarray


class KVBackendView:
    """Pool + tables + allocator + prefix cache + attention, read-only for hosts.

    Attributes (read-only for hosts):
        shape: the model's ``ModelShape``.
        pool: the KV pool (``BaseKVPool``); ``pool.k_cache(layer)`` etc.
        tables: ``PageTable``: ``tables.table`` is the page table, ``tables.token_pool`` the token pool.
        prefix_cache: the ``BasePrefixCache``.
        attention: the ``BaseAttentionBackend`` or ``None``; ``attention_name`` says which.
        allocator: the ``PagedAllocator``.
    """

    def __init__(self, parts: BackendParts) -> None:
        self.shape = parts.shape
        self.pool = parts.pool
        self.tables = parts.tables
        self.rows = parts.rows
        self.allocator = parts.allocator
        self.prefix_cache = parts.prefix_cache
        self.attention = parts.attention
        self.attention_name = parts.attention_name
        self.device = self.tables.device
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._admitted = 0
        self._staged_decode: StagedStep | None = None
        # the last decode step's append_tokens, written by the next decode prepare's launch
        self._deferred_append: DeferredAppend | None = None
        # lifecycle calls so far, and (rows, call number) of the last allocate of every known
        # token: a decode step's allocate -> prepare -> append_tokens chain is recognised by them
        self._calls = 0
        self._filled: tuple | None = None
        # (rows, call number) of the last append_tokens: num_tokens == cached_len + 1 for them
        self._appended: tuple | None = None
        # GPU tables: the decode batch's device fields come from a ring of slots (see DecodeStager)
        # (with the page lists the attention backend plans decode batches with, when it says so)
        self._decode_stager = DecodeStager(
            self.tables.table, self.tables.token_pool, page_size=self.pool.page_size,
            page_list_size=getattr(self.attention, "decode_page_list_size", None),
        )
        # there, a decode step's new pages go into the table in the stager's launch
        self.allocator.defer_decode_pages = not isinstance(self.tables.flat_table, np.ndarray)
        self._finished = 0

    # ------------------------------------------------------------------ shape
    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def max_running_reqs(self) -> int:
        return self.tables.max_running_reqs

    @property
    def max_seq_len(self) -> int:
        return self.tables.max_seq_len

    @property
    def page_table(self) -> torch.Tensor:
        """shape ``[max_running_reqs + 1, row_width]``, int32, device; complete (pages a decode
        ``allocate`` deferred to its ``prepare`` are written first)."""
        self.allocator.flush_deferred_pages()
        return self.tables.table

    @property
    def token_pool(self) -> torch.Tensor:
        """shape ``[max_running_reqs + 1, row_width]``, int32, device; complete (a decode step's
        append deferred to the next ``prepare`` is written first)."""
        self._flush_appends()
        return self.tables.token_pool

    def _flush_appends(self) -> None:
        """Write a deferred ``append_tokens`` into the token pool now (no-op when there is none)."""
        appended = self._deferred_append
        if appended is not None:
            self._deferred_append = None
            self.tables.write_flat_uploaded(self.tables.token_pool, appended.flat_index, appended.device_index,
                                            appended.values)

    @property
    def running_requests(self) -> list[Request]:
        return self.allocator.live_requests

    # ------------------------------------------------------------------ observation
    def stats(self) -> BackendStats:
        allocator = self.allocator
        free = allocator.num_free_pages
        return BackendStats(
            queried_tokens=self._queried_tokens,
            cache_hit_tokens=self._hit_tokens,
            evicted_tokens=allocator.evicted_tokens,
            admitted_requests=self._admitted,
            finished_requests=self._finished,
            running_requests=self.rows.num_live,
            num_pages=self.num_pages,
            free_pages=free,
            cached_pages=allocator.num_cached_pages,
            evictable_pages=allocator.num_evictable_pages,
            used_pages=self.num_pages - free,
        )

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if any memory invariant is broken (reads every live row)."""
        self.rows.check_integrity()
        assert self.rows.live_rows == {r.row for r in self.allocator.live_requests}, "rows and requests disagree"
        self.allocator.check_integrity()
        self.prefix_cache.check_integrity()
