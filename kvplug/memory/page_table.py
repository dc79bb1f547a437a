"""``PageTable``: the two int32 tables of docs/design.md (section 1), one row per running request,
kept on the host first and staged to the device.

``table[r, j]`` is the pool *token location* of request ``r``'s ``j``-th token, whatever the page
size; ``token_pool[r, j]`` is that token's id. Both are ``[max_running_reqs + 1,
align_up(max_seq_len, 32)]`` (rows padded to 128 bytes). The last row belongs to the dummy
request: its table row points at the dummy page and is never written afterwards.

Host first: every location kvplug hands out, and every token id a host gives it, is written into
host arrays (``host_table``, ``host_tokens``) at once; the prefix cache, the allocator and the
integrity checks read those, so no bookkeeping call waits for the device. The device tables
(``table``, ``token_pool``) learn of host writes through **one staged write per step**: each write
marks its row's dirty column range, and ``flush`` uploads every dirty range through one pinned
buffer (one copy, one scatter) - ``KVBackend.prepare`` / ``begin_decode`` call it before the
forward that reads them. On a CPU pool the device tables *are* the host arrays (``mirrored`` is
``False``) and nothing is staged. Two kinds of value never pass through the host: a decode step's
new pages (its staging launch writes them on the device; ``record_decode_pages`` notes them
here) and sampled token ids (``defer_tokens`` below).

Pending tokens: a decode step's commit (``kvplug.decode_step``) hands the table its sampled ids,
on the device, as a ``PendingTokens`` object (``defer_tokens``), without writing them. The table
holds at most one, and ``flush``, the one flush point, takes it once: it returns the ids to a
decode staging launch that covers exactly their cells (``flush(decode_cells)``; the launch writes
them and takes them as its input ids) and writes them otherwise, before the staged host writes
(which may reuse a finished request's cells). Every reader of the device token pool goes
through ``flush``.

Every checked method validates rows and column ranges on the host before touching an array, so a
bad call raises ``InvalidArgumentError`` and changes nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvplug.interface import InvalidArgumentError
from kvplug.memory.pending_tokens import PendingTokens
from kvplug.memory.ragged import HostInts, host_ints, ragged_coordinates

ROW_ALIGNMENT = 32  # int32 entries: 128 bytes
TABLE, TOKENS = 0, 1  # the two planes of the tables' one storage

__all__ = ["ROW_ALIGNMENT", "PageTable", "PendingTokens", "align_up"]


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class _PageLayout(NamedTuple):
    """How ``record_decode_pages`` writes pages of one size (made once per page size).

    Attributes:
        offsets, offsets32: ``0 .. page_size - 1`` as int64 and int32.
        size: ``page_size`` as a 0-d int64 array.
        page_dtype: one page of int32 locations as a single void element.
        pages: the host table viewed as one ``page_dtype`` element per page, or ``None`` when the
            row width is no multiple of the page size (a page may then straddle two rows).
        spread, tiled: shape ``[n]``, int64 and int32; ``i // page_size`` and ``i % page_size``
            for the ``i``-th location of a call's pages (``n``: a page per request row, or more
            once a call needed more); ``None`` when ``pages`` is.
    """

    offsets: np.ndarray
    offsets32: np.ndarray
    size: np.ndarray
    page_dtype: np.dtype
    pages: np.ndarray | None
    spread: np.ndarray | None
    tiled: np.ndarray | None


class PageTable:
    """Page table + token pool, host first (see the module docstring).

    Args:
        max_running_reqs: request rows (the dummy row comes on top).
        max_seq_len: longest request, in tokens.
        dummy_location: first token location of the pool's dummy page.
        device: where the device tables live (the pool's device).
        host_views: whether the device tables are the host arrays' memory; ``None``: whenever
            the device is the CPU. ``False`` on the CPU keeps separate tables and stages writes
            to them as on a GPU (for tests).

    Attributes:
        host_table, host_tokens: shape ``[max_running_reqs + 1, row_width]``, int32, numpy; the
            host arrays every bookkeeping read uses.
        table: same shape, int32, device; token locations (complete after ``flush``).
        token_pool: same shape, int32, device; token ids, initialised to 0 (a valid id, so
            padded slots read a harmless input); a property that flushes first.
    """

    def __init__(
        self,
        max_running_reqs: int,
        max_seq_len: int,
        *,
        dummy_location: int,
        device: torch.device,
        host_views: bool | None = None,
    ) -> None:
        for name, value in (("max_running_reqs", max_running_reqs), ("max_seq_len", max_seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        device = torch.device(device)
        if host_views and device.type != "cpu":
            raise InvalidArgumentError(f"host_views needs tables in CPU memory, not on {device}")
        self.max_running_reqs = max_running_reqs
        self.max_seq_len = max_seq_len
        self.row_width = align_up(max_seq_len, ROW_ALIGNMENT)
        self.dummy_row = max_running_reqs
        self.dummy_location = dummy_location
        shape = (max_running_reqs + 1, self.row_width)
        host = np.zeros((2, *shape), dtype=np.int32)
        host[TABLE, self.dummy_row] = dummy_location
        self.host_table, self.host_tokens = host[TABLE], host[TOKENS]
        self._host_flat = host.reshape(-1)
        self._host_table_flat = self.host_table.reshape(-1)
        self._page_layouts: dict[int, _PageLayout] = {}
        self.mirrored = device.type != "cpu" or host_views is False
        storage = torch.from_numpy(host)
        if self.mirrored:
            storage = storage.to(device) if device.type != "cpu" else storage.clone()
        self._storage_flat = storage.view(-1)
        self.table, self._tokens = storage[TABLE], storage[TOKENS]
        self.device = self.table.device
        self._plane = (max_running_reqs + 1) * self.row_width  # flat offset of the token plane
        # (plane, row) -> [first, end) columns written on the host since the last flush
        self._dirty: dict[tuple[int, int], list[int]] = {}
        self._pending: PendingTokens | None = None
        self._flat_tokens = self._tokens.view(-1)
        self._pin = self.device.type == "cuda"

    @property
    def token_pool(self) -> torch.Tensor:
        """shape ``[max_running_reqs + 1, row_width]``, int32, device; complete (flushed)."""
        self.flush()
        return self._tokens

    @property
    def uses_host_views(self) -> bool:
        """The device tables are the host arrays (a CPU pool): nothing is ever staged."""
        return not self.mirrored

    # ------------------------------------------------------------------ the one staged write
    def flush(self, decode_cells: np.ndarray | None = None) -> torch.Tensor | None:
        """Make the device tables complete: the pending tokens first (a finished request's cells
        may have been reused since), then every host write since the last flush, in one upload
        and one scatter. No host wait (the upload is from pinned memory).

        The one place the pending tokens are taken: with ``decode_cells`` (shape ``[bs]``, int64,
        host; a decode staging launch's new-token cells) equal to their cells, their ids are
        returned for that launch to write (shape ``[bs]``, int32, device) instead of written
        here; otherwise ``None`` is returned."""
        pending = self._pending
        tokens = None
        if pending is not None:
            pending.take(self)
            self._pending = None
            if (decode_cells is not None and pending.flat_index.shape == decode_cells.shape
                    and not np.count_nonzero(pending.flat_index - decode_cells)):
                tokens = pending.values
            else:
                self._flat_tokens.scatter_(0, pending.device_index, pending.values)
        if not self._dirty:
            return tokens
        dirty, self._dirty = self._dirty, {}
        keys = np.array(list(dirty), dtype=np.int64).reshape(-1, 2)
        spans = np.array(list(dirty.values()), dtype=np.int64).reshape(-1, 2)
        starts = keys[:, 0] * self._plane + keys[:, 1] * self.row_width + spans[:, 0]
        lengths = spans[:, 1] - spans[:, 0]
        _, offsets = ragged_coordinates(np.zeros_like(starts), starts, lengths)
        n = offsets.shape[0]
        buffer = torch.empty(3 * n, dtype=torch.int32, pin_memory=self._pin)
        array = buffer.numpy()
        array[: 2 * n].view(np.int64)[:] = offsets
        array[2 * n :] = self._host_flat[offsets]
        on_device = buffer.to(self.device, non_blocking=True)
        self._storage_flat.index_copy_(0, on_device[: 2 * n].view(torch.int64), on_device[2 * n :])
        return tokens

    def _mark(self, plane: int, row: int, start: int, end: int) -> None:
        if not self.mirrored or end <= start:
            return
        span = self._dirty.get((plane, row))
        if span is None:
            self._dirty[(plane, row)] = [start, end]
        else:
            span[0], span[1] = min(span[0], start), max(span[1], end)

    @property
    def has_staged_writes(self) -> bool:
        return bool(self._dirty) or self._pending is not None

    # ------------------------------------------------------------------ pending tokens
    @property
    def pending_tokens(self) -> PendingTokens | None:
        """The one token write accepted and not yet taken by ``flush`` (``None``: none)."""
        return self._pending

    def defer_tokens(self, pending: PendingTokens) -> None:
        """Accept ``pending`` now; the next ``flush`` takes it (see the module docstring). A
        write accepted earlier and still held is flushed first, so the table holds one.
        ``DeferredWorkError`` (nothing changed) for a write already accepted or written. The
        values are read on the device when written: the caller must not modify them in place
        before."""
        pending.bind(self)
        if self._pending is not None:  # two steps committed with no flush between: the older first
            self.flush()
        self._pending = pending

    # ------------------------------------------------------------------ per-step writes (unchecked)
    def write_flat(self, target: torch.Tensor, flat_index: np.ndarray, values: torch.Tensor) -> None:
        """``target.view(-1)[flat_index] = values`` on the device with no checks: the per-step
        path for device values at indices kvplug derived itself (sampled ids into the token
        pool). The host arrays do not see these values.

        Args:
            target: ``token_pool`` (or another device tensor of the table's shape).
            flat_index: shape ``[n]``, int64, host; ``row * row_width + column``, distinct.
            values: shape ``[n]``, int32, device.
        """
        if target is self._tokens:
            if self._pending is not None:  # its cells may be among these: it goes first
                self.flush()
            target = self._flat_tokens
        else:
            target = target.view(-1)
        index = torch.from_numpy(flat_index)
        target.scatter_(0, index if self.device.type == "cpu" else index.to(self.device, non_blocking=True), values)

    def write_row_pages(self, rows: np.ndarray, first_columns: np.ndarray, page_counts: np.ndarray,
                        pages: np.ndarray, page_size: int) -> None:
        """Record new pages, ``page_counts[i]`` of them for row ``rows[i]`` from column
        ``first_columns[i]`` (a page boundary) on, clipped to the row: the allocator's write.

        Args:
            rows, first_columns, page_counts: shape ``[g]``, int64, host.
            pages: shape ``[sum(page_counts)]``, int32, host; first locations, in row order.
        """
        width = self.row_width
        columns = page_counts * page_size
        row_index, column_index = ragged_coordinates(rows, first_columns, columns)
        locations = np.repeat(pages, page_size) + np.tile(np.arange(page_size, dtype=np.int32), pages.shape[0])
        inside = column_index < width
        if not inside.all():
            row_index, column_index, locations = row_index[inside], column_index[inside], locations[inside]
        self.host_table[row_index, column_index] = locations
        if self.mirrored:
            ends = np.minimum(first_columns + columns, width)
            for row, start, end in zip(rows.tolist(), first_columns.tolist(), ends.tolist()):
                self._mark(TABLE, row, start, end)

    def record_decode_pages(self, cells: np.ndarray, pages: np.ndarray, page_size: int) -> None:
        """Note in the host table the pages a decode step's staging launch writes on the device.

        Args:
            cells: shape ``[g]``, int64, host; the flat cell (``row * row_width + column``) where
                each page starts.
            pages: shape ``[g]``, int32, host; their first locations (each page clipped to its row).
        """
        if page_size == 1:  # the per-step case of page size 1: one write
            self._host_table_flat[cells] = pages
            return
        layout = self._page_layouts.get(page_size) or self._page_layout(page_size)
        offsets, offsets32, size, page_dtype, whole, spread, tiled = layout
        if whole is not None:
            # pages start at page-aligned columns (allocated_len is whole pages) of rows of whole pages.
            # NOTE: each page is one void element of the table's view, and its locations come from a
            # 1-D gather and add: no [g, page_size] broadcast, no int64 index per location; needs
            # int32 pages, a row width that is a page multiple and two index arrays per page size
            n = pages.shape[0] * page_size
            if n > spread.shape[0]:  # more pages than request rows: not a decode step's
                layout = self._page_layout(page_size, n)
                spread, tiled = layout.spread, layout.tiled
            whole[cells // size] = (pages[spread[:n]] + tiled[:n]).view(page_dtype)
            return
        # a row width that is no page multiple: a row's last page may reach past its end
        spans = cells[:, None] + offsets
        values = pages[:, None] + offsets32
        columns = cells % self.row_width
        if int(columns.max()) + page_size > self.row_width:
            inside = columns[:, None] + offsets < self.row_width
            spans, values = spans[inside], values[inside]
        self._host_table_flat[spans] = values

    def _page_layout(self, page_size: int, locations: int = 0) -> _PageLayout:
        """``page_size``'s ``_PageLayout``, made and kept (``spread`` and ``tiled`` cover a page
        per request row, or ``locations`` when more)."""
        page_dtype = np.dtype((np.void, page_size * self._host_table_flat.itemsize))
        size = np.array(page_size, dtype=np.int64)
        size.flags.writeable = False
        whole = spread = tiled = None
        if self.row_width % page_size == 0:
            whole = self._host_table_flat.view(page_dtype)
            index = np.arange(max(self.max_running_reqs * page_size, locations), dtype=np.int64)
            spread, tiled = index // page_size, (index % page_size).astype(np.int32)
        layout = self._page_layouts[page_size] = _PageLayout(
            np.arange(page_size, dtype=np.int64), np.arange(page_size, dtype=np.int32), size, page_dtype, whole,
            spread, tiled,
        )
        return layout

    # ------------------------------------------------------------------ page table (checked)
    def locations(self, row: int, start: int, end: int) -> torch.Tensor:
        """Token locations of ``row``'s tokens ``start .. end - 1``: shape ``[end - start]``,
        int32, cpu; a view of the host table (copy it before the row can change)."""
        self._check_range(row, start, end, allow_dummy=True)
        return torch.from_numpy(self.host_table[row, start:end])

    def host_locations(self, row: int, start: int, end: int) -> np.ndarray:
        """``locations`` as a numpy view, unchecked (kvplug's own derived ranges)."""
        return self.host_table[row, start:end]

    def write_locations(self, row: int, start: int, locations: torch.Tensor | np.ndarray) -> None:
        """Write ``locations`` (shape ``[n]``, int32, host: a CPU tensor or numpy array) at
        ``row``'s columns ``start .. start + n - 1``; staged to the device."""
        values = self._host_values(locations, "locations")
        end = start + values.shape[0]
        self._check_range(row, start, end)
        self.host_table[row, start:end] = values
        self._mark(TABLE, row, start, end)

    def scatter_locations(self, flat_index: HostInts, locations: torch.Tensor | np.ndarray) -> None:
        """One scattered write of many rows' locations (checked).

        Args:
            flat_index: shape ``[n]``, int64, host; ``row * row_width + column`` inside the
                request rows (the dummy row, which comes last, is out of range).
            locations: shape ``[n]``, int32, host.
        """
        values = self._host_values(locations, "locations")
        flat_index = host_ints(flat_index, "flat_index")
        limit = self.max_running_reqs * self.row_width
        if flat_index.shape != values.shape or (flat_index.size and (flat_index.min() < 0 or flat_index.max() >= limit)):
            raise InvalidArgumentError(
                f"flat_index must match locations ({tuple(values.shape)}) and lie in [0, {limit}), got shape "
                f"{flat_index.shape}"
            )
        self.host_table.reshape(-1)[flat_index] = values
        for row, column in zip((flat_index // self.row_width).tolist(), (flat_index % self.row_width).tolist()):
            self._mark(TABLE, row, column, column + 1)

    # ------------------------------------------------------------------ token pool (checked)
    def write_tokens(self, row: int, start: int, token_ids: torch.Tensor | np.ndarray) -> None:
        """Write ``token_ids`` (shape ``[n]``, int32, host) at ``row``'s positions ``start ..
        start + n - 1``: into the host arrays now, staged to the device token pool."""
        values = self._host_values(token_ids, "token_ids")
        end = start + values.shape[0]
        self._check_range(row, start, end)
        if not self.mirrored and self._pending is not None:
            self.flush()  # a pending id may be bound for one of these cells
        self.host_tokens[row, start:end] = values
        self._mark(TOKENS, row, start, end)

    def note_tokens(self, row: int, start: int, token_ids: np.ndarray) -> None:
        """Record on the host ids the device token pool already holds (a host's copy of sampled
        ids; ``token_ids``: shape ``[n]``, int32, numpy), unchecked: nothing is staged."""
        self.host_tokens[row, start : start + token_ids.shape[0]] = token_ids

    def host_token_ids(self, row: int, start: int, end: int) -> np.ndarray:
        """Host-known token ids of ``row``'s positions ``start .. end - 1`` (a numpy view, unchecked)."""
        return self.host_tokens[row, start:end]

    def append_tokens(self, rows: HostInts, positions: HostInts, token_ids: torch.Tensor) -> None:
        """One token per request in one scattered device write (decode: sampled ids stay on the
        device; the host arrays do not see them).

        Args:
            rows: shape ``[bs]``, ints, host; request rows.
            positions: shape ``[bs]``, ints, host; column of each new token.
            token_ids: shape ``[bs]``, int32, device.
        """
        rows_host, positions_host = host_ints(rows, "rows"), host_ints(positions, "positions")
        self._check_device_values(token_ids, "token_ids")
        if not rows_host.shape == positions_host.shape == tuple(token_ids.shape):
            raise InvalidArgumentError(
                f"rows, positions and token_ids must have one entry per request, got lengths "
                f"{rows_host.size}, {positions_host.size}, {token_ids.numel()}"
            )
        self._check_rows(rows_host, allow_dummy=False)
        if positions_host.size and (positions_host.min() < 0 or positions_host.max() >= self.row_width):
            raise InvalidArgumentError(f"positions must lie in [0, {self.row_width}), got {positions_host.tolist()}")
        self.flush()
        self.write_flat(self._tokens, rows_host * self.row_width + positions_host, token_ids)

    def read_tokens(self, row: int, start: int, end: int) -> torch.Tensor:
        """Token ids of ``row``'s positions ``start .. end - 1`` in the device token pool: shape
        ``[end - start]``, int32, device (a view; reading it on the host of a GPU pool waits)."""
        self._check_range(row, start, end, allow_dummy=True)
        self.flush()
        return self._tokens[row, start:end]

    def gather_tokens(self, rows: HostInts, starts: HostInts, ends: HostInts) -> torch.Tensor:
        """``input_ids`` of a batch: row ``rows[i]``'s tokens ``starts[i] .. ends[i] - 1``, concatenated.

        Returns:
            shape ``[sum(ends - starts)]``, int32, device.
        """
        rows_host, starts_host, ends_host = host_ints(rows, "rows"), host_ints(starts, "starts"), host_ints(ends, "ends")
        if not rows_host.shape == starts_host.shape == ends_host.shape:
            raise InvalidArgumentError("rows, starts and ends must have one entry per request")
        self._check_rows(rows_host, allow_dummy=True)
        lengths = ends_host - starts_host
        if rows_host.size and (starts_host.min() < 0 or lengths.min() < 0 or ends_host.max() > self.row_width):
            raise InvalidArgumentError(
                f"each range needs 0 <= start <= end <= {self.row_width}, got starts {starts_host.tolist()} "
                f"and ends {ends_host.tolist()}"
            )
        row_index, column_index = ragged_coordinates(rows_host, starts_host, lengths)
        flat_index = torch.from_numpy(row_index * self.row_width + column_index)
        self.flush()
        if self.device.type != "cpu":
            flat_index = flat_index.to(self.device, non_blocking=True)
        return self._flat_tokens[flat_index]

    def gather_tokens_at(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token ids at device-side coordinates, with no host round trip (not validated: both
        come from kvplug's own batch description).

        Args:
            token_rows: shape ``[n]``, int32 or int64, device; the row of every token.
            positions: shape ``[n]``, int32 or int64, device.

        Returns:
            shape ``[n]``, int32, device.
        """
        self.flush()
        return self._tokens[token_rows.long(), positions.long()]

    # ------------------------------------------------------------------ validation
    def check_row(self, row: int, *, allow_dummy: bool) -> None:
        """Raise ``InvalidArgumentError`` unless ``row`` is a request row (or, with ``allow_dummy``, the dummy row)."""
        limit = self.max_running_reqs + 1 if allow_dummy else self.max_running_reqs
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < limit:
            what = "a request row or the dummy row" if allow_dummy else "a request row"
            raise InvalidArgumentError(f"row must be {what}, an int in [0, {limit}), got {row!r}")

    def _check_rows(self, rows: np.ndarray, *, allow_dummy: bool) -> None:
        limit = self.max_running_reqs + 1 if allow_dummy else self.max_running_reqs
        if rows.size and (rows.min() < 0 or rows.max() >= limit):
            raise InvalidArgumentError(f"rows must lie in [0, {limit}), got {rows.tolist()}")

    def _check_range(self, row: int, start: int, end: int, *, allow_dummy: bool = False) -> None:
        self.check_row(row, allow_dummy=allow_dummy)
        if not 0 <= start <= end <= self.row_width:
            raise InvalidArgumentError(
                f"columns [{start}, {end}) must satisfy 0 <= start <= end <= row width {self.row_width}"
            )

    @staticmethod
    def _host_values(values: torch.Tensor | np.ndarray, name: str) -> np.ndarray:
        """``values`` as a 1-D int32 numpy array, or ``InvalidArgumentError``: host data only."""
        if isinstance(values, np.ndarray):
            if values.ndim != 1 or values.dtype != np.int32:
                raise InvalidArgumentError(f"{name} must be shape [n], int32, got {values.shape}, {values.dtype}")
            return values
        if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.dtype != torch.int32:
            raise InvalidArgumentError(
                f"{name} must be shape [n], int32, on the host, got "
                f"{getattr(values, 'shape', None)}, {getattr(values, 'dtype', type(values).__name__)}"
            )
        if values.device.type != "cpu":
            raise InvalidArgumentError(f"{name} must be host data (the page table is kept on the host), got {values.device}")
        return values.numpy()

    def _check_device_values(self, values: torch.Tensor, name: str) -> None:
        if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.dtype != torch.int32:
            raise InvalidArgumentError(
                f"{name} must be shape [n], int32, got {getattr(values, 'shape', None)}, {getattr(values, 'dtype', None)}"
            )
        if values.device != self.device:
            raise InvalidArgumentError(f"{name} must be on {self.device}, got {values.device}")
