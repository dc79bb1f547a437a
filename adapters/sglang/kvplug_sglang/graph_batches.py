"""Fixed-address decode batches for SGLang's decode CUDA graphs, padded with kvplug's dummy request.

kvplug's capturable attention backends read a decode batch through its device tensors
(``table_rows``, ``cached_lens``, ``device_lens``, ``positions``, ``out_loc``): a captured graph
keeps their addresses. ``DecodeGraphBatches`` owns one buffer per field, sized for SGLang's
largest captured batch; the batch of size ``bs`` is views of their first ``bs`` entries, so the
capture of that size and each of its replays read the same memory.

``fill(forward_batch, live)`` writes one step there from the inputs SGLang's decode graph runner
hands the attention backend. SGLang pads a replayed batch up to the captured size with filler
slots (``req_pool_indices`` 0, ``seq_lens`` the backend's fill value); here every slot from
``live`` on becomes kvplug's dummy request instead: the table's dummy row, cached length 0,
device length 1, so its K/V go to the dummy row's one location (SGLang's padding slot, which
SGLang's allocator never hands out) and it attends over that location only. A live request's
K/V and table row are never touched by a padded slot. The device work is a few copies and one
gather on the current stream, with no host sync; the host copies of the lengths come from
SGLang's ``seq_lens_cpu``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvplug.interface import AttentionBatch, ForwardPhase, InvalidArgumentError


class DecodeGraphBatches:
    """Static decode batches over ``page_table`` for batch sizes ``1 .. max_bs``.

    Args:
        page_table: SGLang's ``req_to_token`` in kvplug's layout (``KvplugReqToTokenPool``):
            shape ``[max_running_reqs + 2, max_context_len]``, int32, device, contiguous; its last
            row is the dummy request's.
        max_bs: the largest batch SGLang captures.
    """

    def __init__(self, page_table: torch.Tensor, max_bs: int) -> None:
        if isinstance(max_bs, bool) or not isinstance(max_bs, int) or max_bs < 1:
            raise InvalidArgumentError(f"max_bs must be a positive int, got {max_bs!r}")
        self.page_table = page_table
        self.max_bs = max_bs
        self.dummy_row = page_table.shape[0] - 1
        self.row_width = page_table.shape[1]
        self._flat_table = page_table.view(-1)
        device = page_table.device

        def buffer() -> torch.Tensor:
            return torch.zeros(max_bs, dtype=torch.int32, device=device)

        self.rows, self.cached, self.device_lens, self.out_loc = buffer(), buffer(), buffer(), buffer()
        # a decode batch's extend_start is 0 .. bs, the first bs + 1 entries of one arange
        self.extend_start_cpu = torch.arange(max_bs + 1, dtype=torch.int32)
        self.extend_start = self.extend_start_cpu.to(device)
        self.cached_cpu = torch.zeros(max_bs, dtype=torch.int32)
        self.device_lens_cpu = torch.zeros(max_bs, dtype=torch.int32)

    def fill(self, forward_batch: Any, live: int) -> AttentionBatch:
        """The decode batch of ``forward_batch`` in the fixed buffers, slots ``live ..`` dummy.

        Args:
            forward_batch: SGLang's graph-runner batch (a ``ForwardBatch`` at capture, its replay
                view at replay): ``batch_size`` (the captured size), ``req_pool_indices`` and
                ``seq_lens`` (shape ``[batch_size]``, integers, device) and ``seq_lens_cpu``
                (the same, host, or ``None``); only their first ``live`` entries are read.
            live: how many leading slots are live requests (0 at capture: every slot is dummy).

        Raises:
            InvalidArgumentError: a batch larger than ``max_bs``, ``live`` outside ``[0, bs]``, or
                a live request whose length is not in ``[1, row width]`` (nothing is written then).
        """
        bs = int(forward_batch.batch_size)
        if not 1 <= bs <= self.max_bs:
            raise InvalidArgumentError(f"graph batch size must lie in [1, {self.max_bs}], got {bs}")
        if not 0 <= live <= bs:
            raise InvalidArgumentError(f"live requests must lie in [0, {bs}], got {live}")
        host_device_lens = self.device_lens_cpu[:bs].numpy()
        if live:
            seq_lens_cpu = forward_batch.seq_lens_cpu
            if seq_lens_cpu is None:  # SGLang keeps a host copy for backends that need one (we do)
                seq_lens_cpu = forward_batch.seq_lens[:live].cpu()
            lens = np.asarray(seq_lens_cpu[:live])
            if lens.min() < 1 or lens.max() > self.row_width:
                raise InvalidArgumentError(
                    f"decode requests need 1 <= seq_len <= row width {self.row_width}, got seq_lens {lens.tolist()}"
                )
            host_device_lens[:live] = lens
        host_device_lens[live:] = 1
        np.subtract(host_device_lens, 1, out=self.cached_cpu[:bs].numpy())

        rows, cached, device_lens, out_loc = self.rows[:bs], self.cached[:bs], self.device_lens[:bs], self.out_loc[:bs]
        if live:
            rows[:live].copy_(forward_batch.req_pool_indices[:live])
            device_lens[:live].copy_(forward_batch.seq_lens[:live])
        if live < bs:
            rows[live:].fill_(self.dummy_row)
            device_lens[live:].fill_(1)
        torch.sub(device_lens, 1, out=cached)
        # each new token's location, as SGLang wrote it into the table (the dummy row's is slot 0)
        torch.index_select(self._flat_table, 0, torch.add(cached, rows, alpha=self.row_width), out=out_loc)
        return AttentionBatch(
            phase=ForwardPhase.DECODE,
            table_rows=rows,
            cached_lens=cached,
            device_lens=device_lens,
            cached_lens_cpu=self.cached_cpu[:bs],
            device_lens_cpu=self.device_lens_cpu[:bs],
            extend_start=self.extend_start[: bs + 1],
            extend_start_cpu=self.extend_start_cpu[: bs + 1],
            positions=cached,
            out_loc=out_loc,
            page_table=self.page_table,
            num_padded=bs - live,
        )
