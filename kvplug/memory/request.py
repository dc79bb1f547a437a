"""The memory state of running requests: per-row length arrays, and ``Request`` views onto them.

Host-neutral: a host adapter keeps one ``Request`` per sequence it runs and passes it back to
``KVBackend`` methods; it reads the lengths but never writes them.

Lengths (all in tokens) of a live request::

    0 ........ prefix_len ........ cached_len ........ device_len ........ num_tokens
    |-- cache's pages --|-- this request's pages (K/V in pool) --|-- next forward --|
    |<------------------------- allocated_len (whole pages) ----------------------->|

- ``prefix_len``: tokens covered by the locked cache handle; their pages belong to the cache.
- ``cached_len``: tokens whose K/V are in the pool.
- ``device_len``: tokens the next forward covers; it writes K/V for ``cached_len .. device_len - 1``.
- ``allocated_len``: tokens that have a location in the table row (a multiple of the page size).
- ``num_tokens``: token ids written into the token pool (prompt plus appended tokens).

The lengths live in numpy arrays indexed by row (``RequestStates``), so batch operations over
hundreds of requests are a handful of vector operations plus one pass to collect row keys. That
pass (about 10 us at 256 requests) is skipped when a call names the same requests, in the same
order, as the previous one and no request was admitted or finished since: decode steps over a
steady batch (``begin_decode`` and its ``commit``, or ``allocate``, ``prepare`` and
``append_tokens``) then pay it once per change of the running batch.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import numpy as np

from kvplug.interface import BaseCacheHandle, InvalidArgumentError

LENGTH_FIELDS = ("cached_len", "device_len", "allocated_len", "num_tokens")
# the high bits of every request key in the process (see RequestStates.claim); 2**31 keys a row
_KEY_SERIALS = itertools.count(1)
ROW_BITS = 32
ROW_MASK = (1 << ROW_BITS) - 1


class BatchRows(NamedTuple):
    """Where a batch of requests lives in the tables (both read-only, shared by repeated calls).

    Attributes:
        rows: shape ``[bs]``, int64, host; each request's row.
        row_starts: shape ``[bs]``, int64, host; ``rows * row_width``, the flat index of each
            row's column 0 in the page table and token pool.
    """

    rows: np.ndarray
    row_starts: np.ndarray


class RequestStates:
    """Host-side arrays ``[num_rows]``, int64, one entry per page-table row.

    ``key[row]`` identifies the live request in ``row`` (``generation << 32 | row``; -1 when the
    row is free), so a stale ``Request`` whose row was reused is told apart from the new one.
    ``key`` changes only through ``claim`` and ``release``.

    Args:
        num_rows: request rows.
        row_width: columns of a table row (for ``BatchRows.row_starts``).
    """

    def __init__(self, num_rows: int, row_width: int = 1) -> None:
        self.num_rows = num_rows
        self.row_width = row_width
        self.cached_len = np.zeros(num_rows, dtype=np.int64)
        self.device_len = np.zeros(num_rows, dtype=np.int64)
        self.allocated_len = np.zeros(num_rows, dtype=np.int64)
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)
        self.key = np.full(num_rows, -1, dtype=np.int64)
        self._generation = 0
        # rows_of's memo: the last validated request list, its rows, and the generation they were
        # validated at (any claim or release bumps it, which invalidates the memo)
        self._memo_requests: list | None = None
        self._memo_rows = BatchRows(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        self._memo_generation = -1

    @property
    def generation(self) -> int:
        """Bumped by every ``claim`` and ``release``: unchanged means the same requests are live."""
        return self._generation

    def claim(self, row: int) -> int:
        """Give ``row`` a fresh key (a new request starts there) and return it. Keys come from one
        counter per process, so a ``Request`` of another backend never matches a key here."""
        self._generation += 1
        key = next(_KEY_SERIALS) << ROW_BITS | row
        self.key[row] = key
        return key

    def release(self, row: int) -> None:
        """``row``'s request is gone: its key no longer matches any ``Request``."""
        self._generation += 1
        self.key[row] = -1

    def rows_of(self, requests: Sequence["Request"]) -> np.ndarray:
        """Rows of ``requests`` (shape ``[bs]``, int64, read-only), checking each is live and
        appears once."""
        return self.batch_rows(requests).rows

    def batch_rows(self, requests: Sequence["Request"]) -> BatchRows:
        """``rows_of(requests)`` and the rows' flat starts, memoised for a repeated batch."""
        memo = self._memo_requests
        if memo is not None and self._memo_generation == self._generation and len(requests) == len(memo):
            try:
                # C-level identity comparison; keys cannot have changed since the generation did not
                if memo == requests or memo == list(requests):
                    return self._memo_rows
            except Exception:  # an element with an exotic __eq__: take the checked path
                pass
        rows = self._check_rows(requests)
        row_starts = rows * self.row_width
        rows.flags.writeable = row_starts.flags.writeable = False
        self._memo_requests, self._memo_generation = list(requests), self._generation
        self._memo_rows = BatchRows(rows, row_starts)
        return self._memo_rows

    def _check_rows(self, requests: Sequence["Request"]) -> np.ndarray:
        try:
            keys = np.fromiter((request.key for request in requests), dtype=np.int64, count=len(requests))
        except (AttributeError, TypeError):
            bad = next((r for r in requests if not isinstance(r, Request)), None)
            raise InvalidArgumentError(f"expected a sequence of kvplug Requests, got {type(bad).__name__}") from None
        rows = keys & ROW_MASK
        stale = self.key[rows] != keys
        if stale.any():
            row = int(rows[np.flatnonzero(stale)[0]])
            raise InvalidArgumentError(f"request in row {row} is not live (finished, or not from this backend)")
        if rows.size > 1 and np.bincount(rows, minlength=1).max() > 1:
            raise InvalidArgumentError(f"a request appears twice in one call: rows {rows.tolist()}")
        return rows


class Request:
    """One running request: its row, its cache handle and views of its lengths.

    Attributes:
        row: its page-table / token-pool row.
        prompt_len: tokens given at admission.
        matched_len: tokens found in the prefix cache at admission.
        handle: the locked prefix-cache handle (``None`` once finished).
        finished: set by ``finish``; a finished request may not be used again.
    """

    __slots__ = ("row", "key", "prompt_len", "matched_len", "handle", "finished", "_states", "_index")

    def __init__(self, states: RequestStates, row: int, prompt_len: int, matched_len: int, handle: BaseCacheHandle):
        self.row = row
        self.key = states.claim(row)
        self.prompt_len = prompt_len
        self.matched_len = matched_len
        self.handle: BaseCacheHandle | None = handle
        self.finished = False
        self._states = states
        self._index = row
        for name, value in zip(LENGTH_FIELDS, (matched_len, matched_len, matched_len, prompt_len)):
            getattr(states, name)[row] = value

    cached_len = property(lambda self: int(self._states.cached_len[self._index]), doc="tokens with K/V in the pool")
    device_len = property(lambda self: int(self._states.device_len[self._index]), doc="tokens the next forward covers")
    allocated_len = property(lambda self: int(self._states.allocated_len[self._index]), doc="tokens with a location")
    num_tokens = property(lambda self: int(self._states.num_tokens[self._index]), doc="token ids in the token pool")

    @property
    def prefix_len(self) -> int:
        """Tokens whose pages belong to the prefix cache (locked by ``handle``)."""
        return 0 if self.handle is None else int(self.handle.cached_len)

    @property
    def extend_len(self) -> int:
        """Tokens the next forward computes: ``device_len - cached_len``."""
        return self.device_len - self.cached_len

    def lengths(self) -> dict[str, int]:
        """All lengths at once (for logging and tests)."""
        return {name: getattr(self, name) for name in (*LENGTH_FIELDS, "prefix_len")}

    def _detach(self) -> None:
        """Keep the final lengths privately and release the row's entry (called on finish)."""
        private = RequestStates(1)
        for name in LENGTH_FIELDS:
            getattr(private, name)[0] = getattr(self, name)
        self._states.release(self.row)
        self._states, self._index = private, 0

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value}" for name, value in self.lengths().items())
        return f"Request(row={self.row}, {fields}, finished={self.finished})"
