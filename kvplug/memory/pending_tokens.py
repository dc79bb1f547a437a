"""``PendingTokens``: the sampled ids one decode step's commit hands the page table, written once.

Why an object: a commit on device tables (``DecodeStep.commit``) does not write its ids into the
token pool; the next staging launch over the same cells writes them and reads them as its input
ids, which saves a scatter and a gather per step. Until then the write is deferred work with one
owner, the table it was handed to (``PageTable.defer_tokens``), and one taker, that table's
``flush`` (the one flush point): it gives the ids to the launch or scatters them, never both and
never twice. Writing them twice could overwrite a newer id (a row reused by another request), so
a second take, or a take by another table, raises ``DeferredWorkError`` with nothing changed.
"""

from __future__ import annotations

import numpy as np
import torch

from kvplug.interface import DeferredWorkError

__all__ = ["PendingTokens"]


class PendingTokens:
    """Token ids a page table accepted but has not written into its token pool yet.

    Attributes:
        flat_index: shape ``[bs]``, int64, host; their cells (``row * row_width + position``), distinct.
        device_index: shape ``[bs]``, int64, table device; the same cells.
        values: shape ``[bs]``, int32, table device, contiguous; the ids (read in stream order
            when written: not to be modified in place before).
    """

    __slots__ = ("flat_index", "device_index", "values", "_owner", "_taken")

    def __init__(self, flat_index: np.ndarray, device_index: torch.Tensor, values: torch.Tensor) -> None:
        self.flat_index = flat_index
        self.device_index = device_index
        self.values = values
        self._owner: object = None
        self._taken = False

    @property
    def taken(self) -> bool:
        return self._taken

    @property
    def owner(self) -> object:
        """The table that accepted it (``None`` before ``PageTable.defer_tokens``)."""
        return self._owner

    def bind(self, owner: object) -> None:
        """Give the write to ``owner`` (a ``PageTable``), once; ``DeferredWorkError`` otherwise."""
        if self._taken or self._owner is not None:
            raise DeferredWorkError(
                f"expected a token write not yet handed to a table, got one "
                f"{'written already' if self._taken else 'another table holds'} ({self.flat_index.shape[0]} ids): "
                "each commit's ids are written once, by the table that accepted them"
            )
        self._owner = owner

    def take(self, owner: object) -> "PendingTokens":
        """Mark the write taken by ``owner``'s flush, which makes it now; returns ``self``."""
        if self._taken or owner is not self._owner:
            raise DeferredWorkError(
                "expected the pending token write of this table, got "
                + (f"one written already ({self.flat_index.shape[0]} ids)" if self._taken
                   else f"one this table did not accept ({self.flat_index.shape[0]} ids)")
                + "; nothing was written"
            )
        self._taken = True
        return self
