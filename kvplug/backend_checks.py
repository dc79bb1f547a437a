"""What ``KVBackend``'s per-step calls refuse, and how they say so (``InvalidArgumentError``,
naming the row and the lengths). Only the checks the length invariants leave open are made:
rows are live and distinct, ``cached_len <= device_len <= allocated_len`` and ``device_len <=
max_seq_len`` hold by construction."""

from __future__ import annotations

import numpy as np

from kvplug.interface import ForwardPhase, InvalidArgumentError


def check_new_tokens(rows: np.ndarray, cached: np.ndarray, device_lens: np.ndarray, phase: ForwardPhase) -> None:
    """Raise unless a decode forward has exactly one new token per request, a prefill at least
    one (all shape ``[bs]``, int64, host)."""
    extend = device_lens - cached
    decode = phase is ForwardPhase.DECODE
    if np.count_nonzero(extend - 1) if decode else np.count_nonzero(extend < 1):
        i = int((extend != 1 if decode else extend < 1).nonzero()[0][0])
        wanted = "exactly one new token (decode)" if decode else "at least one new token"
        raise InvalidArgumentError(
            f"request in row {rows[i]}: a {phase.value} forward needs {wanted}, got cached_len={cached[i]}, "
            f"device_len={device_lens[i]}; call allocate() first"
        )


def reject_append(
    rows: np.ndarray, cached: np.ndarray, device_lens: np.ndarray, num_tokens: np.ndarray, not_ready: np.ndarray,
    max_seq_len: int,
) -> None:
    """Raise for an ``append_tokens`` that is not ready (``not_ready``: shape ``[bs]``, bool) or
    would pass ``max_seq_len``; the arrays: shape ``[bs]``, int64, host."""
    if not_ready.any():
        i = int(np.flatnonzero(not_ready)[0])
        raise InvalidArgumentError(
            f"request in row {rows[i]}: append_tokens follows a forward over all known tokens "
            f"(cached_len < device_len == num_tokens), got cached_len={cached[i]}, "
            f"device_len={device_lens[i]}, num_tokens={num_tokens[i]}"
        )
    row = rows[int(np.flatnonzero(num_tokens >= max_seq_len)[0])]
    raise InvalidArgumentError(f"request in row {row} already holds max_seq_len={max_seq_len} tokens; finish it")


def reject_decode(rows: np.ndarray, cached: np.ndarray, num_tokens: np.ndarray, max_seq_len: int) -> None:
    """Raise for a ``begin_decode`` whose requests do not all hold exactly one known token past
    their cached ones (all shape ``[bs]``, int64, host)."""
    i = int(np.flatnonzero(num_tokens - cached - 1)[0])
    hint = (
        f"it holds max_seq_len={max_seq_len} tokens; finish it" if num_tokens[i] >= max_seq_len
        else "call append_tokens after its prefill, or commit the previous decode step"
    )
    raise InvalidArgumentError(
        f"request in row {rows[i]}: a decode step needs exactly one known token past the cached ones "
        f"(num_tokens == cached_len + 1), got cached_len={cached[i]}, num_tokens={num_tokens[i]}; {hint}"
    )
