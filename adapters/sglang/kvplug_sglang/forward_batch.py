"""An SGLang ``ForwardBatch`` as kvplug's host-neutral ``AttentionBatch``.

SGLang's req-to-token table *is* a token-granular page table (row = request slot, column = token
position, value = token location), so the translation is only lengths: request ``i`` sits in
row ``req_pool_indices[i]``, has ``extend_prefix_lens[i]`` tokens cached (``seq_lens[i] - 1`` in
decode) and attends to ``seq_lens[i]``. kvplug's ``build_attention_batch`` derives positions and
``out_loc`` from the table, so they equal SGLang's ``positions`` / ``out_cache_loc`` whenever SGLang
has written the new tokens' locations into the table, which it does before every forward.
Host copies (``*_cpu``) are read when SGLang provides them, so building a batch does not sync.
"""

from __future__ import annotations

from typing import Any

import torch

from kvplug.attention import build_attention_batch
from kvplug.interface import AttentionBatch, ForwardPhase

# ForwardMode names kvplug attention runs; speculative and diffusion modes are not wired
_PHASES = {"EXTEND": ForwardPhase.PREFILL, "MIXED": ForwardPhase.PREFILL, "DECODE": ForwardPhase.DECODE}


def phase_of(forward_mode: Any) -> ForwardPhase:
    """kvplug phase for an SGLang ``ForwardMode``; other modes raise ``NotImplementedError``."""
    phase = _PHASES.get(forward_mode.name)
    if phase is None:
        raise NotImplementedError(
            f"kvplug attention runs SGLang EXTEND, MIXED and DECODE batches, not {forward_mode.name} "
            "(speculative decoding and diffusion modes are not wired)"
        )
    return phase


def _host(values: Any, fallback: Any) -> Any:
    """Host integers: SGLang's ``*_cpu`` copy when it has one, else the device tensor copied back."""
    if values is not None:
        return values
    return fallback.cpu() if isinstance(fallback, torch.Tensor) else fallback


def attention_batch_from_forward_batch(forward_batch: Any, page_table: torch.Tensor) -> AttentionBatch:
    """kvplug's description of ``forward_batch`` over ``page_table``.

    Args:
        forward_batch: SGLang ``ForwardBatch`` in EXTEND, MIXED or DECODE mode.
        page_table: SGLang's ``req_to_token`` in kvplug's layout (``KvplugReqToTokenPool``):
            shape ``[max_running_reqs + 2, max_context_len]``, int32, device; the last row is the
            dummy request's.
    """
    phase = phase_of(forward_batch.forward_mode)
    rows = _host(forward_batch.req_pool_indices_cpu, forward_batch.req_pool_indices)
    device_lens = _host(forward_batch.seq_lens_cpu, forward_batch.seq_lens)
    if phase is ForwardPhase.DECODE:
        cached_lens = torch.as_tensor(device_lens) - 1
    else:
        cached_lens = _host(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_prefix_lens)
    return build_attention_batch(page_table, rows, cached_lens, device_lens, phase)
