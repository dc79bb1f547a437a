"""``PageTable``: the two int32 tables of docs/design.md (section 1), one row per running request, and every access
to them.

``table[r, j]`` is the pool *token location* of request ``r``'s ``j``-th token, whatever the page
size; ``token_pool[r, j]`` is that token's id. Both are ``[max_running_reqs + 1,
align_up(max_seq_len, 32)]`` on the pool's device (rows padded to 128 bytes). The last row belongs
to the dummy request: its table row points at the dummy page and is never written afterwards.

Every method but ``write_flat`` and ``write_pages`` (the per-step paths for indices kvplug derived
itself) validates rows and column ranges on the host before touching a tensor, so a bad call
raises ``InvalidArgumentError`` and changes nothing.

Pending tokens: a decode step's commit (``kvplug.decode_step``) hands the table its sampled ids
without writing them - the next decode step's staging launch writes them and takes them as its
input ids, sparing a scatter and a gather per step on a GPU host. The write is the table's to
make: ``take_pending_tokens`` gives it to that launch when the next step covers exactly the same
cells, and every other access of the token pool (each method below, the ``token_pool``
property) makes it first. Nothing outside this class sees a token pool without it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvplug.interface import InvalidArgumentError
from kvplug.memory.ragged import HostInts, host_ints, ragged_coordinates
from kvplug.tensor_checks import check_int32_vector

ROW_ALIGNMENT = 32  # int32 entries: 128 bytes

__all__ = ["ROW_ALIGNMENT", "PageTable", "PendingTokens", "align_up"]


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class PendingTokens(NamedTuple):
    """Token ids the table accepted but has not written into the token pool yet.

    Attributes:
        flat_index: shape ``[bs]``, int64, host; their cells (``row * row_width + position``), distinct.
        device_index: shape ``[bs]``, int64, table device; the same cells.
        values: shape ``[bs]``, int32, table device, contiguous; the ids.
    """

    flat_index: np.ndarray
    device_index: torch.Tensor
    values: torch.Tensor


class PageTable:
    """Page table + token pool (see the module docstring).

    Args:
        max_running_reqs: request rows (the dummy row comes on top).
        max_seq_len: longest request, in tokens.
        dummy_location: first token location of the pool's dummy page.
        device: where both tables live (the pool's device).
        host_views: make the per-step writes through numpy views (a third of torch's host cost);
            ``None``: whenever the tables are in CPU memory. ``False`` on the CPU runs the torch
            path a GPU table takes (for tests).

    Attributes:
        table: shape ``[max_running_reqs + 1, row_width]``, int32, device; token locations.
        token_pool: same shape, int32, device; token ids, initialised to 0 (a valid id, so
            padded slots read a harmless input); a property that writes pending tokens first.
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
        self.max_running_reqs = max_running_reqs
        self.max_seq_len = max_seq_len
        self.row_width = align_up(max_seq_len, ROW_ALIGNMENT)
        self.dummy_row = max_running_reqs
        self.dummy_location = dummy_location
        shape = (max_running_reqs + 1, self.row_width)
        self.table = torch.zeros(shape, dtype=torch.int32, device=device)
        self.table[self.dummy_row].fill_(dummy_location)
        self._tokens = torch.zeros(shape, dtype=torch.int32, device=device)
        self.device = self.table.device
        self._pending: PendingTokens | None = None
        # flat views for the per-step scattered writes (a view costs ~1 us to make); in CPU memory
        # they are numpy views, whose scattered writes cost a third of torch's
        self._flat_table = self.table.view(-1)
        self._flat_tokens = self._tokens.view(-1)
        self._on_host = self.device.type == "cpu" if host_views is None else bool(host_views)
        if self._on_host and self.device.type != "cpu":
            raise InvalidArgumentError(f"host_views needs tables in CPU memory, not on {self.device}")
        if self._on_host:
            self._flat_table, self._flat_tokens = self._flat_table.numpy(), self._flat_tokens.numpy()
        # page size -> (the table viewed as page-sized slots, 0 .. page_size - 1), made on first use
        self._page_views: dict[int, tuple] = {}

    @property
    def token_pool(self) -> torch.Tensor:
        """shape ``[max_running_reqs + 1, row_width]``, int32, device; complete (pending tokens written)."""
        self.settle_tokens()
        return self._tokens

    @property
    def flat_table(self) -> torch.Tensor | np.ndarray:
        """``table.view(-1)``: shape ``[(max_running_reqs + 1) * row_width]``, int32; a numpy view
        when the per-step path uses host views (``build_decode_batch`` then gathers on the host)."""
        return self._flat_table

    @property
    def uses_host_views(self) -> bool:
        return self._on_host

    # ------------------------------------------------------------------ pending tokens
    def defer_tokens(self, pending: PendingTokens) -> None:
        """Accept ``pending`` now, write it later (see the module docstring); a previous pending
        write is made first. The values are read on the device when written: the caller must
        not modify them in place before."""
        self.settle_tokens()
        self._pending = pending

    def take_pending_tokens(self, flat_index: np.ndarray) -> torch.Tensor | None:
        """The pending ids, for a launch that writes them at ``flat_index`` (shape ``[bs]``,
        int64, host) and uses them there - when those are exactly their cells; otherwise they
        are written now and ``None`` is returned. Either way nothing is pending afterwards."""
        pending = self._pending
        if pending is None:
            return None
        if pending.flat_index.shape == flat_index.shape and not np.count_nonzero(pending.flat_index - flat_index):
            self._pending = None
            return pending.values
        self.settle_tokens()
        return None

    def settle_tokens(self) -> None:
        """Write the pending tokens into the token pool now (no-op when none are pending)."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            if self._on_host:
                self._flat_tokens[pending.flat_index] = pending.values.numpy()
            else:
                self._flat_tokens.scatter_(0, pending.device_index, pending.values)

    # ------------------------------------------------------------------ per-step writes (unchecked)
    def write_flat(self, target: torch.Tensor, flat_index: np.ndarray, values: torch.Tensor) -> None:
        """``target.view(-1)[flat_index] = values`` with no checks: the per-step path for indices
        kvplug derived itself from validated rows and lengths.

        Args:
            target: ``table`` or ``token_pool``.
            flat_index: shape ``[n]``, int64, host; ``row * row_width + column``, distinct.
            values: shape ``[n]``, int32, device.
        """
        if target is self.table:
            flat = self._flat_table
        elif target is self._tokens:
            self.settle_tokens()
            flat = self._flat_tokens
        else:
            target.view(-1)[index_on_device(flat_index, self.device)] = values
            return
        if self._on_host:
            flat[flat_index] = values.numpy()
        else:  # scatter_ is the cheapest scattered write on the host side; indices are distinct
            flat.scatter_(0, index_on_device(flat_index, self.device), values)

    def write_pages(self, page_index: np.ndarray, page_starts: torch.Tensor, page_size: int) -> None:
        """Record whole pages with no checks: the allocator's per-step write. For a page size
        ``P`` that divides ``row_width``, slot ``page_index[i]`` of ``table.view(-1, P)`` gets
        ``page_starts[i] + 0 .. P - 1``.

        Args:
            page_index: shape ``[n]``, int64, host; ``row * (row_width // P) + page number``, distinct.
            page_starts: shape ``[n]``, int32, device; first token location of each page.
        """
        cached = self._page_views.get(page_size)
        if cached is None:
            offsets = torch.arange(page_size, dtype=torch.int32, device=self.device)
            cached = self._page_views[page_size] = (
                self._flat_table.reshape(-1, page_size), offsets.numpy() if self._on_host else offsets
            )
        view, offsets = cached
        if self._on_host:
            view[page_index] = page_starts.numpy()[:, None] + offsets
        else:
            view.index_copy_(0, index_on_device(page_index, self.device), page_starts.view(-1, 1) + offsets)

    # ------------------------------------------------------------------ page table (checked)
    def locations(self, row: int, start: int, end: int) -> torch.Tensor:
        """Token locations of ``row``'s tokens ``start .. end - 1``: shape ``[end - start]``,
        int32, device; a view (copy it before the row can change)."""
        self._check_range(row, start, end, allow_dummy=True)
        return self.table[row, start:end]

    def write_locations(self, row: int, start: int, locations: torch.Tensor) -> None:
        """Write ``locations`` (shape ``[n]``, int32, device) at ``row``'s columns ``start .. start + n - 1``."""
        self._check_values(locations, "locations")
        self._check_range(row, start, start + locations.shape[0])
        self.table[row, start : start + locations.shape[0]] = locations

    def scatter_locations(self, flat_index: HostInts, locations: torch.Tensor) -> None:
        """One scattered write of many rows' locations (the allocator's per-batch write).

        Args:
            flat_index: shape ``[n]``, int64, host; ``row * row_width + column`` inside the
                request rows (the dummy row, which comes last, is out of range).
            locations: shape ``[n]``, int32, device.
        """
        self._check_values(locations, "locations")
        flat_index = host_ints(flat_index, "flat_index")
        limit = self.max_running_reqs * self.row_width
        if flat_index.shape != locations.shape or (flat_index.size and (flat_index.min() < 0 or flat_index.max() >= limit)):
            raise InvalidArgumentError(
                f"flat_index must match locations ({tuple(locations.shape)}) and lie in [0, {limit}), got shape "
                f"{flat_index.shape}"
            )
        self.write_flat(self.table, flat_index, locations)

    # ------------------------------------------------------------------ token pool (checked)
    def write_tokens(self, row: int, start: int, token_ids: torch.Tensor) -> None:
        """Write ``token_ids`` (shape ``[n]``, int32, device) at ``row``'s positions ``start .. start + n - 1``."""
        self._check_values(token_ids, "token_ids")
        self._check_range(row, start, start + token_ids.shape[0])
        self.settle_tokens()
        self._tokens[row, start : start + token_ids.shape[0]] = token_ids

    def append_tokens(self, rows: HostInts, positions: HostInts, token_ids: torch.Tensor) -> None:
        """One token per request in one scattered write (decode: sampled ids stay on the device).

        Args:
            rows: shape ``[bs]``, ints, host; request rows.
            positions: shape ``[bs]``, ints, host; column of each new token.
            token_ids: shape ``[bs]``, int32, device.
        """
        rows_host, positions_host = host_ints(rows, "rows"), host_ints(positions, "positions")
        self._check_values(token_ids, "token_ids")
        if not rows_host.shape == positions_host.shape == tuple(token_ids.shape):
            raise InvalidArgumentError(
                f"rows, positions and token_ids must have one entry per request, got lengths "
                f"{rows_host.size}, {positions_host.size}, {token_ids.numel()}"
            )
        self._check_rows(rows_host, allow_dummy=False)
        if positions_host.size and (positions_host.min() < 0 or positions_host.max() >= self.row_width):
            raise InvalidArgumentError(f"positions must lie in [0, {self.row_width}), got {positions_host.tolist()}")
        self.write_flat(self._tokens, rows_host * self.row_width + positions_host, token_ids)

    def read_tokens(self, row: int, start: int, end: int) -> torch.Tensor:
        """Token ids of ``row``'s positions ``start .. end - 1``: shape ``[end - start]``, int32, device (a view)."""
        self._check_range(row, start, end, allow_dummy=True)
        self.settle_tokens()
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
        flat_index = row_index * self.row_width + column_index
        self.settle_tokens()
        return self._tokens.view(-1)[index_on_device(flat_index, self.device)]

    def gather_tokens_at(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token ids at device-side coordinates, with no host round trip (not validated: both
        come from kvplug's own batch description).

        Args:
            token_rows: shape ``[n]``, int32 or int64, device; the row of every token.
            positions: shape ``[n]``, int32 or int64, device.

        Returns:
            shape ``[n]``, int32, device.
        """
        self.settle_tokens()
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

    def _check_values(self, values: torch.Tensor, name: str) -> None:
        check_int32_vector(values, self.device, name)


def index_on_device(index: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host index array as a device tensor (no copy on CPU; one host-to-device copy otherwise)."""
    index_tensor = torch.from_numpy(index)
    return index_tensor if device.type == "cpu" else index_tensor.to(device, non_blocking=True)
