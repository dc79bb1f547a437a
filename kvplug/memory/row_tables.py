"""The two int32 tables behind the page table and the token pool: one row per running request
(SPEC §1), their unchecked per-step write and the host-side checks every other access makes.

``table[r, j]`` is the pool *token location* of request ``r``'s ``j``-th token, whatever the page
size; ``token_pool[r, j]`` is that token's id. Both are ``[max_running_reqs + 1,
align_up(max_seq_len, 32)]`` on the pool's device (rows padded to 128 bytes). The last row belongs
to the dummy request: its table row points at the dummy page and is never written afterwards.
"""

from __future__ import annotations

import numpy as np
import torch

from kvplug.interface import InvalidArgumentError
from kvplug.tensor_checks import check_int32_vector

ROW_ALIGNMENT = 32  # int32 entries: 128 bytes


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class RowTables:
    """Page table + token pool storage (``PageTable`` adds the accessors).

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
            padded slots read a harmless input).
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
        self.token_pool = torch.zeros(shape, dtype=torch.int32, device=device)
        self.device = self.table.device
        # flat views for the per-step scattered writes (a view costs ~1 us to make); in CPU memory
        # they are numpy views, whose scattered writes cost a third of torch's
        self._flat_table = self.table.view(-1)
        self._flat_token_pool = self.token_pool.view(-1)
        self._on_host = self.device.type == "cpu" if host_views is None else bool(host_views)
        if self._on_host and self.device.type != "cpu":
            raise InvalidArgumentError(f"host_views needs tables in CPU memory, not on {self.device}")
        if self._on_host:
            self._flat_table, self._flat_token_pool = self._flat_table.numpy(), self._flat_token_pool.numpy()
        # page size -> (the table viewed as page-sized slots, 0 .. page_size - 1), made on first use
        self._page_views: dict[int, tuple] = {}

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
        elif target is self.token_pool:
            flat = self._flat_token_pool
        else:
            target.view(-1)[index_on_device(flat_index, self.device)] = values
            return
        if self._on_host:
            flat[flat_index] = values.numpy()
        else:  # scatter_ is the cheapest scattered write on the host side; indices are distinct
            flat.scatter_(0, index_on_device(flat_index, self.device), values)

    def write_flat_uploaded(
        self, target: torch.Tensor, flat_index: np.ndarray, device_index: torch.Tensor, values: torch.Tensor
    ) -> None:
        """``write_flat`` with the index also on the device already (uploaded with a batch), so
        a GPU table pays one scatter and no copy.

        Args:
            target: ``table`` or ``token_pool``.
            flat_index: shape ``[n]``, int64, host; distinct.
            device_index: shape ``[n]``, int64, table device; the same values.
            values: shape ``[n]``, int32, device.
        """
        if self._on_host:
            self.write_flat(target, flat_index, values)
            return
        flat = self._flat_table if target is self.table else self._flat_token_pool
        flat.scatter_(0, device_index, values)

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
