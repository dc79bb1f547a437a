"""A decode step's token append deferred to the next step's staging launch (GPU tables).

``append_tokens`` after a staged decode step writes one sampled id per request into the token
pool: on the H200 hosts a scatter costs 12-15 us of host time, and the next step's
``input_ids`` gathers the same cells back (another 15-19 us). Deferred, the next decode
``prepare`` over the same batch hands the ids to ``DecodeStager``, whose launch writes them into
the token pool and uses them as that step's input ids - both without a call of their own.

Until then the token pool lacks them, so ``KVBackend`` writes them first (one scatter, as
before) wherever anything else reads or writes the token pool or the batch changes: admit,
prepare of another batch or phase, ``input_ids`` of another batch, another ``append_tokens``,
``cache_unfinished``, ``finish`` and the ``token_pool`` property. The ids are read on the device
in stream order, so the tensor given to ``append_tokens`` must not be modified in place before
the next ``prepare`` (sampled ids never are; hosts that reuse a buffer pass a copy).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class DeferredAppend(NamedTuple):
    """One ``append_tokens`` of a staged decode batch, not yet in the token pool.

    Attributes:
        rows: the ``states.batch_rows`` array of that call (its identity names the batch; the
            next step's token cell of request ``i`` is this append's cell ``i``).
        flat_index: shape ``[bs]``, int64, host; the token-pool cells (``row * row_width +
            position``).
        device_index: shape ``[bs]``, int64, table device; the same cells (staged with the batch).
        values: shape ``[bs]``, int32, table device, contiguous; the sampled ids.
    """

    rows: np.ndarray
    flat_index: np.ndarray
    device_index: torch.Tensor
    values: torch.Tensor
