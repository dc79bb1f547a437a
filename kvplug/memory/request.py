"""Request state, owned by one object: ``RequestTable`` (rows, liveness, lengths), and ``Request``
views onto it.

Host-neutral: a host adapter keeps one ``Request`` per sequence it runs and passes it back to
``KVBackend`` methods; it reads the lengths but never writes them. Nothing but the transitions of
``RequestTable`` below writes a length, a row's liveness or a request's handle.

Lengths (all in tokens) of a live request::

    0 ........ prefix_len ........ cached_len ........ device_len ........ num_tokens
    |-- cache's pages --|-- this request's pages (K/V in pool) --|-- next forward --|
    |<------------------------- allocated_len (whole pages) ----------------------->|

- ``prefix_len``: tokens covered by the locked cache handle; their pages belong to the cache.
- ``cached_len``: tokens whose K/V are in the pool.
- ``device_len``: tokens the next forward covers; it writes K/V for ``cached_len .. device_len - 1``.
- ``allocated_len``: tokens that have a location in the table row (a multiple of the page size).
- ``num_tokens``: token ids written into the token pool (prompt plus appended tokens).
- ``known_len``: token ids the host knows (the prompt, and sampled ids given as host values or
  through ``KVBackend.record_tokens``): only those can be keys of the prefix cache.

The transitions, in a request's order: ``open`` (admission: a row, the match), ``reserve``
(pages: ``allocated_len``), ``schedule`` (``device_len``), ``computed`` (the forward ran:
``cached_len = device_len``), ``appended`` / ``decoded`` (a sampled token became the next one),
``know`` (host ids), ``rehandle`` (the locked prefix moved into the cache), ``close``.

The lengths live in numpy arrays indexed by row, so batch transitions over hundreds of requests
are a handful of vector operations plus one pass to collect row keys. That pass is skipped when a
call names the same requests, in the same order, as the previous one and no request was opened or
closed since (``batch_rows``' memo). Every transition that writes a cached length bumps
``cached_version``, so a staged decode step's commit compares its requests' cached lengths only
when some moved since it was staged.

Leases (``BatchLease``, below): a batch names token locations of its requests' rows. Once one of
those requests is finished, its pages go back to the free list (or the prefix cache) and may be
another request's the next moment: a forward over the old batch would write K/V into them. A
batch therefore carries a lease, checked before it is used (``KVBackend.forward``,
``DecodeGraphs.run``) at the cost of one integer comparison while no request started or ended.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import numpy as np

from kvplug.interface import BaseCacheHandle, InvalidArgumentError, OutOfMemoryError

LENGTH_FIELDS = ("cached_len", "device_len", "allocated_len", "num_tokens", "known_len")
# the high bits of every request key in the process (see RequestTable.open); 2**31 keys a row
_KEY_SERIALS = itertools.count(1)
ROW_BITS = 32
ROW_MASK = (1 << ROW_BITS) - 1
# NOTE: 1 as a read-only 0-d int64 array for the per-step length sums of int64 arrays: numpy
# handles an array operand faster than a Python int (whose dtype it works out on every call)
ONE = np.array(1, dtype=np.int64)
ONE.flags.writeable = False


class BatchRows(NamedTuple):
    """Where a batch of requests lives in the tables (both read-only, shared by repeated calls).

    Attributes:
        rows: shape ``[bs]``, int64, host; each request's row.
        row_starts: shape ``[bs]``, int64, host; ``rows * row_width``, the flat index of each
            row's column 0 in the page table and token pool.
    """

    rows: np.ndarray
    row_starts: np.ndarray


class RequestTable:
    """The one owner of request state: which rows are live, by which request, at which lengths.

    Arrays ``[num_rows]``, int64, one entry per page-table row (read them; the transitions write
    them). ``key[row]`` identifies the live request in ``row`` (``serial << 32 | row``; -1 when
    the row is free), so a stale ``Request`` whose row was reused is told apart from the new one.

    Args:
        num_rows: request rows (``max_running_reqs``).
        row_width: columns of a table row (for ``BatchRows.row_starts``).
    """

    def __init__(self, num_rows: int, row_width: int = 1) -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
            raise InvalidArgumentError(f"max_running_reqs must be a positive int, got {num_rows!r}")
        self.num_rows = num_rows
        self.row_width = row_width
        self.cached_len = np.zeros(num_rows, dtype=np.int64)
        self.device_len = np.zeros(num_rows, dtype=np.int64)
        self.allocated_len = np.zeros(num_rows, dtype=np.int64)
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)
        self.known_len = np.zeros(num_rows, dtype=np.int64)
        self.key = np.full(num_rows, -1, dtype=np.int64)
        self._live: dict[int, Request] = {}
        # a stack popped from the end: low rows first keeps the live part of the table compact
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._generation = 0
        self._cached_version = 0  # bumped by every transition that writes a cached length
        # batch_rows' memo: the last validated request list, its rows, and the generation they were
        # validated at (any open or close bumps it, which invalidates the memo)
        self._memo_requests: list | None = None
        self._memo_rows = BatchRows(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        self._memo_generation = -1

    # ------------------------------------------------------------------ reading
    @property
    def generation(self) -> int:
        """Bumped by every ``open`` and ``close``: unchanged means the same requests are live."""
        return self._generation

    @property
    def cached_version(self) -> int:
        """Bumped by every transition that writes ``cached_len`` (``open``, ``computed``,
        ``appended``, ``decoded``): unchanged means no cached length changed."""
        return self._cached_version

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def live_requests(self) -> list["Request"]:
        return list(self._live.values())

    def is_live(self, request: object) -> bool:
        return isinstance(request, Request) and not request.finished and self._live.get(request.row) is request

    def free_row(self) -> int:
        """The row the next ``open`` should take; ``OutOfMemoryError`` when every row is live."""
        if not self._free_rows:
            raise OutOfMemoryError(
                f"no free page-table row: all max_running_reqs={self.num_rows} rows are in use; "
                "finish a request first or raise max_running_reqs"
            )
        return self._free_rows[-1]

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
        if rows.size and rows.max() >= self.num_rows:
            raise InvalidArgumentError("a request is not from this backend")
        stale = self.key[rows] != keys
        if stale.any():
            row = int(rows[np.flatnonzero(stale)[0]])
            raise InvalidArgumentError(f"request in row {row} is not live (finished, or not from this backend)")
        if rows.size > 1 and np.bincount(rows, minlength=1).max() > 1:
            raise InvalidArgumentError(f"a request appears twice in one call: rows {rows.tolist()}")
        return rows

    # ------------------------------------------------------------------ transitions
    def open(self, row: int, prompt_len: int, matched_len: int, handle: BaseCacheHandle) -> "Request":
        """A request starts in free ``row``: its prompt's ids are known and ``matched_len`` of
        them are cached (by ``handle``, locked)."""
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.num_rows:
            raise InvalidArgumentError(f"row must be a request row, an int in [0, {self.num_rows}), got {row!r}")
        if row in self._live:
            raise InvalidArgumentError(f"row {row} already belongs to a live request")
        if self._free_rows and self._free_rows[-1] == row:
            self._free_rows.pop()
        else:
            self._free_rows.remove(row)
        self._generation += 1
        self._cached_version += 1
        key = next(_KEY_SERIALS) << ROW_BITS | row
        self.key[row] = key
        for name, value in zip(LENGTH_FIELDS, (matched_len, matched_len, matched_len, prompt_len, prompt_len)):
            getattr(self, name)[row] = value
        request = Request(self, row, key, prompt_len, matched_len, handle)
        self._live[row] = request
        return request

    def reserve(self, rows: np.ndarray, allocated: np.ndarray) -> None:
        """Rows ``rows`` now hold locations for ``allocated`` tokens (whole pages)."""
        self.allocated_len[rows] = allocated

    def schedule(self, rows: np.ndarray, device_lens: np.ndarray) -> None:
        """The next forward over ``rows`` covers tokens up to ``device_lens``."""
        self.device_len[rows] = device_lens

    def computed(self, rows: np.ndarray) -> None:
        """The forward over ``rows`` ran: their K/V up to ``device_len`` is in the pool."""
        self._cached_version += 1
        self.cached_len[rows] = self.device_len[rows]

    def appended(self, rows: np.ndarray, *, known: bool) -> None:
        """A forward over every known token ran and one sampled id per row was appended
        (``known``: given as host values)."""
        num_tokens = self.num_tokens[rows]
        self._cached_version += 1
        self.cached_len[rows] = self.device_len[rows]
        self.num_tokens[rows] = num_tokens + ONE
        if known:
            self._extend_known(rows, num_tokens)

    def decoded(self, rows: np.ndarray, cached: np.ndarray, stored: np.ndarray | None, *, known: bool) -> None:
        """A decode step over ``rows`` (cached lengths ``cached``) ran: one more token each is
        cached, and the sampled ids become the next tokens of the rows ``stored`` (a mask;
        ``None``: all) - a row at ``max_seq_len`` keeps its K/V but stores no token."""
        following = cached + ONE  # the new cached lengths, where each sampled id goes
        self._cached_version += 1
        self.cached_len[rows] = following
        if stored is None:
            target = rows
        else:
            target, following = rows[stored], following[stored]
        self.num_tokens[target] = following + ONE
        if known:
            self._extend_known(target, following)

    def _extend_known(self, rows: np.ndarray, before: np.ndarray) -> None:
        """Ids at ``before`` became known where the host knew every id up to there."""
        contiguous = self.known_len[rows] == before
        self.known_len[rows[contiguous]] = before[contiguous] + ONE

    def know(self, row: int, known_len: int) -> None:
        """The host knows ``row``'s first ``known_len`` ids (``<= num_tokens``)."""
        self.known_len[row] = known_len

    def rehandle(self, request: "Request", handle: BaseCacheHandle | None) -> None:
        """``request``'s locked prefix is now ``handle`` (``None``: nothing locked)."""
        request._handle = handle

    def close(self, request: "Request") -> None:
        """``request`` ended: it keeps its final lengths privately and its row is free."""
        row = request.row
        request._detach({name: int(getattr(self, name)[row]) for name in LENGTH_FIELDS})
        self._generation += 1
        self.key[row] = -1
        del self._live[row]
        self._free_rows.append(row)

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Every row is free or live exactly once, and keys agree with the live requests."""
        free = self._free_rows
        assert len(free) == len(set(free)), "a row is free twice"
        assert not set(self._live).intersection(free), "a row is both free and live"
        assert len(free) + len(self._live) == self.num_rows, "a row went missing"
        assert sorted(int(row) for row in (self.key >= 0).nonzero()[0]) == sorted(self._live), "keys and live rows disagree"
        for row, request in self._live.items():
            assert self.key[row] == request.key, f"row {row}: key differs from its request's"
            assert (self.cached_len[row] <= self.device_len[row] <= self.num_tokens[row]
                    and self.known_len[row] <= self.num_tokens[row]), f"row {row}: lengths out of order"


class Request:
    """One running request: its row, its cache handle and views of its lengths.

    Attributes:
        row: its page-table / token-pool row.
        prompt_len: tokens given at admission.
        matched_len: tokens found in the prefix cache at admission.
        handle: the locked prefix-cache handle (``None`` once finished).
        finished: set when it ends; a finished request may not be used again.
    """

    __slots__ = ("row", "key", "prompt_len", "matched_len", "_handle", "_table", "_final")

    def __init__(self, table: RequestTable, row: int, key: int, prompt_len: int, matched_len: int,
                 handle: BaseCacheHandle) -> None:
        self.row = row
        self.key = key
        self.prompt_len = prompt_len
        self.matched_len = matched_len
        self._handle: BaseCacheHandle | None = handle
        self._table = table
        self._final: dict[str, int] | None = None

    def _length(name: str, doc: str) -> property:  # noqa: N805 - a helper run while the class body is built
        def get(self: "Request") -> int:
            final = self._final
            return int(getattr(self._table, name)[self.row]) if final is None else final[name]

        return property(get, doc=doc)

    cached_len = _length("cached_len", "tokens with K/V in the pool")
    device_len = _length("device_len", "tokens the next forward covers")
    allocated_len = _length("allocated_len", "tokens with a location")
    num_tokens = _length("num_tokens", "token ids in the token pool")
    known_len = _length("known_len", "token ids the host knows")
    del _length

    @property
    def handle(self) -> BaseCacheHandle | None:
        return self._handle

    @property
    def finished(self) -> bool:
        return self._final is not None

    @property
    def prefix_len(self) -> int:
        """Tokens whose pages belong to the prefix cache (locked by ``handle``)."""
        return 0 if self._handle is None else int(self._handle.cached_len)

    @property
    def extend_len(self) -> int:
        """Tokens the next forward computes: ``device_len - cached_len``."""
        return self.device_len - self.cached_len

    def lengths(self) -> dict[str, int]:
        """All lengths at once (for logging and tests)."""
        return {name: getattr(self, name) for name in (*LENGTH_FIELDS, "prefix_len")}

    def _detach(self, final: dict[str, int]) -> None:
        self._final = final
        self._handle = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value}" for name, value in self.lengths().items())
        return f"Request(row={self.row}, {fields}, finished={self.finished})"


# ---------------------------------------------------------------------- leases


class BatchLease(NamedTuple):
    """Which requests a batch this backend prepared covers (``AttentionBatch.lease``), so that
    ``forward`` refuses it once one of them was finished (its pages may have been handed out).

    Attributes:
        states: the backend's ``RequestTable`` (a batch of another backend is refused).
        generation: ``states.generation`` at ``prepare``: while it is unchanged no request started
            or ended, and nothing needs checking.
        requests: the requests, in batch order.
    """

    states: RequestTable
    generation: int
    requests: tuple


def check_lease(lease: BatchLease, states: RequestTable) -> None:
    """Raise unless every request of the lease is still live in ``states`` (the slow path, taken
    only when a request started or ended since the batch was prepared)."""
    if lease.states is not states:
        raise InvalidArgumentError("this batch was prepared by another KVBackend")
    keys = np.fromiter((request.key for request in lease.requests), np.int64, len(lease.requests))
    rows = keys & ROW_MASK
    stale = states.key[rows] != keys
    if stale.any():
        raise InvalidArgumentError(
            f"the request in row {int(rows[np.flatnonzero(stale)[0]])} was finished after this batch was prepared; "
            "its pages may belong to another request now: prepare the batch again"
        )
