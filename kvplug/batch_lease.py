"""``BatchLease``: which requests a batch a ``KVBackend`` prepared covers, checked before the
batch is used (``KVBackend.forward``, ``DecodeGraphs.run``).

A batch names token locations of its requests' rows. Once one of those requests is finished, its
pages go back to the free list (or the prefix cache) and may be another request's the next
moment: a forward over the old batch would write K/V into them. The lease makes that an error
at the cost of one integer comparison per use while no request started or ended.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvplug.interface import InvalidArgumentError
from kvplug.memory.request import ROW_MASK, RequestTable


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
