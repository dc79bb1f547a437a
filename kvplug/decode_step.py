"""``DecodeStep``: one staged decode step, as an object the host holds from staging to commit.

``KVBackend.begin_decode(requests)`` takes each request's one new token (pages for those that
cross a page boundary), stages the step's batch and input ids (into a CUDA graph's fixed
buffers when the backend has graphs for the batch size, padded with the dummy request) and plans
attention; it returns a ``DecodeStep``. The host runs its forward over ``step.batch`` (or
``DecodeGraphs.run(step)``), samples, and calls ``step.commit(token_ids)``: the forward's K/V
count as cached and each sampled id becomes its request's next token. Device ids are handed to
the page table as pending tokens (``PageTable.defer_tokens``): the next step over the same
requests writes them in its staging launch and reads them as its input ids. A step is committed
once; nothing else carries state from one call to the next.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvplug.interface import AttentionBatch, InvalidArgumentError
from kvplug.memory.page_table import PageTable, PendingTokens
from kvplug.memory.request import RequestTable
from kvplug.memory.token_ids import as_token_ids, host_token_ids


class DecodeStep:
    """A staged decode step of ``len(requests)`` live requests (see the module docstring).

    Attributes:
        requests: the live requests, in batch order.
        batch: the ``AttentionBatch`` (``batch_size >= len(requests)``: padded with the dummy
            request when staged for a CUDA graph, ``batch.num_padded`` of them last).
        input_ids: shape ``[batch.batch_size]``, int32, device; each request's new token.
        positions: shape ``[batch.batch_size]``, int32, device; its position (= cached length).
        out_loc: shape ``[batch.batch_size]``, int32, device; the pool location its K/V go to.
        graph_size: the captured batch size it was staged for, or ``None`` (eager).
        committed: whether ``commit`` ran.

    The tensors are views of staging buffers that later steps reuse (a ring of ``ring_size``
    steps, or the graph's fixed buffers for the next step of the same size): run the forward
    before staging more steps than that.
    """

    __slots__ = (
        "requests", "batch", "input_ids", "graph_size", "committed", "stamp",
        "_tables", "_states", "_rows", "_generation", "_cached",
    )

    def __init__(
        self,
        tables: PageTable,
        states: RequestTable,
        batch: AttentionBatch,
        rows: np.ndarray,
        cached: np.ndarray,
        graph_size: int | None = None,
        stamp: int = 0,
    ) -> None:
        self.requests = batch.lease.requests
        self.batch = batch
        self.input_ids = batch.input_ids
        self.graph_size = graph_size
        self.committed = False
        self.stamp = stamp
        self._tables = tables
        self._states = states
        self._rows = rows
        self._generation = states.generation  # which requests were live
        self._cached = cached

    @property
    def positions(self) -> torch.Tensor:
        return self.batch.positions

    @property
    def out_loc(self) -> torch.Tensor:
        return self.batch.out_loc

    @property
    def num_live(self) -> int:
        """Live requests (the batch's first ``num_live`` entries)."""
        return len(self.requests)

    def commit(self, token_ids: torch.Tensor | Sequence[int]) -> None:
        """The forward over this step ran: its K/V count as cached, and ``token_ids[i]`` becomes
        request ``i``'s next token (the next step's input). Requests that reached
        ``max_seq_len`` tokens keep their K/V but store no token (the host finishes them; a
        later ``begin_decode`` refuses them).

        Args:
            token_ids: shape ``[num_live]``, int32: a device tensor stays on the device and is
                read in stream order later (do not modify it in place before the next step is
                staged); host values (a list or CPU tensor) are also known to the host side.

        Raises ``InvalidArgumentError`` (nothing changed) for a second commit, ids of the wrong
        shape, or when a request of the step was finished or moved on since it was staged.
        """
        tables, states = self._tables, self._states
        if self.committed:
            raise InvalidArgumentError("this decode step is already committed")
        device = tables.device
        on_host = not (isinstance(token_ids, torch.Tensor) and token_ids.device.type != "cpu")
        if not on_host and type(token_ids) is torch.Tensor and token_ids.dtype is torch.int32 and token_ids.device == device:
            # sampled ids on the GPU: values are not read here (a sync); host ids are range-checked
            ids = token_ids if token_ids.is_contiguous() else token_ids.contiguous()
        else:
            ids = as_token_ids(token_ids, device, allow_empty=True)
        rows, cached = self._rows, self._cached
        if ids.dim() != 1 or ids.shape[0] != rows.size:
            raise InvalidArgumentError(
                f"need one token id per request: {rows.size} requests, token ids of shape {tuple(ids.shape)}"
            )
        # the same requests are live while no request started or ended (the usual case); else
        # each request's key says whether it is still the one staged
        finished = states.generation != self._generation and np.count_nonzero(
            states.key[rows] - np.fromiter((request.key for request in self.requests), np.int64, rows.size)
        )
        if finished or np.count_nonzero(states.cached_len[rows] - cached):
            raise InvalidArgumentError(
                "a request of this decode step was finished or changed since it was staged; commit a step "
                "before finishing its requests"
            )
        self.committed = True
        cells = rows * tables.row_width + cached + 1  # where each sampled id goes
        stored = None
        if cached.max() + 2 > tables.max_seq_len:  # some sampled tokens have no cell: finish those
            stored = cached + 2 <= tables.max_seq_len
            keep = np.flatnonzero(stored)
            if keep.size:
                tables.write_flat(tables._tokens, cells[keep], ids[torch.from_numpy(keep).to(ids.device)])
        elif tables.uses_host_views:
            tables.write_flat(tables._tokens, cells, ids)
        else:
            # the next step's staging launch writes them (and reads them as its input ids)
            append_index = self.batch.append_index
            if append_index.shape[0] != rows.size:  # padded for a graph: the live requests come first
                append_index = append_index[: rows.size]
            tables.defer_tokens(PendingTokens(cells, append_index, ids))
        if on_host:
            values = host_token_ids(token_ids, allow_empty=True).numpy()
            target = cells if stored is None else cells[stored]
            tables.host_tokens.reshape(-1)[target] = values if stored is None else values[stored]
        states.decoded(rows, cached, stored, known=on_host)

    def __repr__(self) -> str:
        return (
            f"DecodeStep(requests={self.num_live}, batch_size={self.batch.batch_size}, graph_size={self.graph_size}, "
            f"committed={self.committed})"
        )
