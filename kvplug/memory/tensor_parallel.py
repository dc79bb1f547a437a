"""How a model's KV heads are shared among tensor-parallel ranks.

Two layouts are valid:

- **split**: ``tp_size`` divides the global KV-head count; rank ``r`` keeps heads
  ``[r * H / tp, (r + 1) * H / tp)``.
- **replicated**: ``tp_size`` is a multiple of the head count (more ranks than heads, as with
  GQA models on 8 GPUs); every rank keeps exactly one head, and ``tp_size / H`` consecutive ranks
  keep the same one.

Anything else would leave ranks with unequal or fractional shares and is rejected.
"""

from __future__ import annotations

from kvplug.interface import InvalidArgumentError


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank keeps.

    Raises:
        InvalidArgumentError: neither ``tp_size`` divides ``num_kv_heads`` nor ``num_kv_heads``
            divides ``tp_size``.
    """
    _check_positive("num_kv_heads", num_kv_heads)
    _check_positive("tp_size", tp_size)
    if num_kv_heads % tp_size == 0:
        return num_kv_heads // tp_size
    if tp_size > num_kv_heads and tp_size % num_kv_heads == 0:
        return 1
    raise InvalidArgumentError(
        f"cannot share {num_kv_heads} KV heads among tp_size={tp_size} ranks: expected tp_size to divide "
        f"the head count, or to be a multiple of it (replication), got neither"
    )


def local_kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global KV-head indices ``[start, stop)`` that rank ``tp_rank`` keeps (a host slices its
    projection weights with them)."""
    heads = local_kv_heads(num_kv_heads, tp_size)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise InvalidArgumentError(f"tp_rank must be an int in [0, {tp_size}), got {tp_rank!r}")
    if num_kv_heads % tp_size == 0:
        return tp_rank * heads, (tp_rank + 1) * heads
    ranks_per_head = tp_size // num_kv_heads
    head = tp_rank // ranks_per_head
    return head, head + 1


def local_qo_heads(num_qo_heads: int, tp_size: int) -> int:
    """Query heads each rank keeps; query heads are always split evenly."""
    _check_positive("num_qo_heads", num_qo_heads)
    _check_positive("tp_size", tp_size)
    if num_qo_heads % tp_size:
        raise InvalidArgumentError(
            f"tp_size={tp_size} must divide the query-head count, got {num_qo_heads} query heads"
        )
    return num_qo_heads // tp_size


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
