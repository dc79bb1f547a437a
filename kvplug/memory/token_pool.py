"""The token pool's accessors: token ids by request row and position, written when a request is
admitted or a token sampled, gathered for a batch's ``input_ids`` and read back when caching.

Like the page table's, every method but ``gather_tokens_at`` (device-side coordinates kvplug
derived itself) validates rows and positions on the host first, so a bad call raises
``InvalidArgumentError`` and changes nothing.
"""

from __future__ import annotations

import torch

from kvplug.interface import InvalidArgumentError
from kvplug.memory.ragged import HostInts, host_ints, ragged_coordinates
from kvplug.memory.row_tables import RowTables, index_on_device


class TokenPoolTables(RowTables):
    """``RowTables`` with the token pool's accessors (``PageTable`` adds the page table's)."""

    def write_tokens(self, row: int, start: int, token_ids: torch.Tensor) -> None:
        """Write ``token_ids`` (shape ``[n]``, int32, device) at ``row``'s positions ``start .. start + n - 1``."""
        self._check_values(token_ids, "token_ids")
        self._check_range(row, start, start + token_ids.shape[0])
        self.token_pool[row, start : start + token_ids.shape[0]] = token_ids

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
        self.write_flat(self.token_pool, rows_host * self.row_width + positions_host, token_ids)

    def read_tokens(self, row: int, start: int, end: int) -> torch.Tensor:
        """Token ids of ``row``'s positions ``start .. end - 1``: shape ``[end - start]``, int32, device (a view)."""
        self._check_range(row, start, end, allow_dummy=True)
        return self.token_pool[row, start:end]

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
        return self.token_pool.view(-1)[index_on_device(flat_index, self.device)]

    def gather_tokens_at(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token ids at device-side coordinates, with no host round trip (not validated: both
        come from kvplug's own batch description).

        Args:
            token_rows: shape ``[n]``, int32 or int64, device; the row of every token.
            positions: shape ``[n]``, int32 or int64, device.

        Returns:
            shape ``[n]``, int32, device.
        """
        return self.token_pool[token_rows.long(), positions.long()]
