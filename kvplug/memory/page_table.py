"""The page table: token locations by request row and column (SPEC §1), and ``PageTable``, the
object that owns it together with the token pool.

``table[r, j]`` is the pool *token location* of request ``r``'s ``j``-th token, whatever the page
size (layout and dummy row: ``kvplug.memory.row_tables``; token ids: ``kvplug.memory.token_pool``).

Every method but ``write_flat`` and ``write_pages`` (the per-step paths for indices kvplug derived
itself) validates rows and column ranges on the host before touching a tensor, so a bad call
raises ``InvalidArgumentError`` and changes nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from kvplug.interface import InvalidArgumentError
from kvplug.memory.ragged import HostInts, host_ints
from kvplug.memory.row_tables import ROW_ALIGNMENT, align_up, index_on_device
from kvplug.memory.token_pool import TokenPoolTables

__all__ = ["ROW_ALIGNMENT", "PageTable", "align_up"]


class PageTable(TokenPoolTables):
    """Page table + token pool: the storage and checks of ``RowTables``, the token pool's
    accessors of ``TokenPoolTables`` and, here, the page table's.
    """

    @property
    def flat_table(self) -> torch.Tensor | np.ndarray:
        """``table.view(-1)``: shape ``[(max_running_reqs + 1) * row_width]``, int32; a numpy view
        when the per-step path uses host views (``build_decode_batch`` then gathers on the host)."""
        return self._flat_table

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
