"""Sizing the kvplug pool for a transformers model: pages, tokens, bytes, rows, batch tokens.

Planning needs only the model's config, so ``kvplug serve`` runs it before loading any weights and
refuses a budget that cannot hold one request of ``max_seq_len`` tokens (the scheduler could never
finish such a request). The same plan is used when transformers later creates its cache.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from kvplug.interface import InvalidArgumentError
from kvplug.memory.capacity import num_pages_for_budget, parse_memory_size
from kvplug.memory.host_tier_size import host_tier_pages
from kvplug.memory.model_shape import ModelShape

from kvplug_transformers.settings import KVPlugSettings

CPU_DEFAULT_BUDGET = 1 << 30  # bytes
CPU_DEFAULT_FRACTION = 0.25
DEFAULT_MAX_SEQ_LEN = 4096  # when the config names no context length
DEFAULT_BATCH_TOKENS = {"cpu": 2048, "cuda": 8192}


class PoolPlan(NamedTuple):
    """A sized pool.

    Attributes:
        num_pages: usable pages (the dummy page comes on top).
        page_size: tokens per page.
        bytes_per_token: K+V bytes of one token over all layers.
        max_running_reqs: page-table rows for requests.
        max_seq_len: longest request, tokens.
        max_batch_tokens: tokens per forward step.
        source: what sized it (``num_pages``, ``kv_memory bytes``, ``kv_memory fraction``, ...).
    """

    num_pages: int
    page_size: int
    bytes_per_token: int
    max_running_reqs: int
    max_seq_len: int
    max_batch_tokens: int
    source: str

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def pool_bytes(self) -> int:
        """Bytes of the pool tensor, dummy page included."""
        return (self.num_pages + 1) * self.page_size * self.bytes_per_token

    def describe(self) -> str:
        return (
            f"{self.num_tokens:,} tokens = {self.num_pages:,} pages x {self.page_size} tokens, "
            f"{self.pool_bytes:,} bytes ({self.pool_bytes / 2**20:.1f} MiB, {self.bytes_per_token:,} B/token); "
            f"{self.max_running_reqs} request rows of up to {self.max_seq_len:,} tokens; "
            f"{self.max_batch_tokens:,} tokens per step; sized by {self.source}"
        )


def model_shape(config, dtype: torch.dtype) -> ModelShape:
    """The KV geometry of a transformers config (text config of multimodal models) in ``dtype``."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelShape.from_hf_config(text_config, dtype=dtype)


def model_context_len(config) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text_config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else DEFAULT_MAX_SEQ_LEN


def free_memory(device: torch.device) -> int:
    """Bytes free for the pool on ``device`` right now."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def plan_pool(
    settings: KVPlugSettings,
    shape: ModelShape,
    device: torch.device | str,
    *,
    context_len: int,
    cb_num_blocks: int | None = None,
    cb_block_size: int | None = None,
    cb_max_batch_tokens: int | None = None,
    max_memory_percent: float | None = None,
) -> PoolPlan:
    """Size the pool for ``shape`` on ``device``.

    Raises ``InvalidArgumentError`` when the pool cannot hold one request of ``max_seq_len``
    tokens, naming the budget, what it holds and what one request needs.
    """
    device = torch.device(device)
    page_size = settings.page_size
    max_seq_len = settings.max_seq_len or context_len
    bytes_per_token = shape.kv_bytes_per_token()
    page_bytes = bytes_per_token * page_size
    # more pages than every row filled to max_seq_len could never be used
    useful_pages = -(-settings.max_running_reqs * max_seq_len // page_size)
    if settings.num_pages is not None:
        num_pages, source = settings.num_pages, "num_pages"
    elif isinstance(settings.kv_memory, int):
        num_pages, source = _pages_for(bytes_per_token, page_size, settings.kv_memory), "kv_memory bytes"
    elif isinstance(settings.kv_memory, float):
        budget = int(free_memory(device) * settings.kv_memory)
        num_pages = min(_pages_for(bytes_per_token, page_size, budget), useful_pages)
        source = f"kv_memory fraction {settings.kv_memory:g} of free memory"
    elif cb_num_blocks is not None and cb_block_size is not None:
        num_pages = -(-cb_num_blocks * cb_block_size // page_size)
        source = "ContinuousBatchingConfig.num_blocks"
    else:
        if device.type == "cuda":
            fraction = max_memory_percent if max_memory_percent is not None else 0.9
            budget, source = int(free_memory(device) * fraction), f"{fraction:g} of free CUDA memory"
        else:
            budget = min(CPU_DEFAULT_BUDGET, int(free_memory(device) * CPU_DEFAULT_FRACTION))
            source = "CPU default min(1 GiB, 25% of available RAM)"
        num_pages = min(_pages_for(bytes_per_token, page_size, budget), useful_pages)
    if num_pages * page_size < max_seq_len:
        needed_pages = -(-max_seq_len // page_size)
        raise InvalidArgumentError(
            f"the KV pool is too small for one request: it holds {num_pages * page_size:,} tokens "
            f"({num_pages:,} pages of {page_size}, {num_pages * page_bytes:,} bytes, sized by {source}) but one "
            f"request may need max_seq_len={max_seq_len:,} tokens ({needed_pages:,} pages, "
            f"{(needed_pages + 1) * page_bytes:,} bytes with the dummy page); raise the KV memory or lower max_seq_len"
        )
    if settings.host_memory is not None:  # issue 32: a tier below one page or past free memory fails here, at start-up
        pool_in_host = (num_pages + 1) * page_bytes if device.type == "cpu" else 0
        host_tier_pages(parse_memory_size(settings.host_memory), page_bytes, also_needed=pool_in_host)
    default_batch = DEFAULT_BATCH_TOKENS.get(device.type, DEFAULT_BATCH_TOKENS["cpu"])
    max_batch_tokens = settings.max_batch_tokens or cb_max_batch_tokens or default_batch
    return PoolPlan(
        num_pages=num_pages,
        page_size=page_size,
        bytes_per_token=bytes_per_token,
        max_running_reqs=settings.max_running_reqs,
        max_seq_len=max_seq_len,
        max_batch_tokens=max_batch_tokens,
        source=source,
    )


def _pages_for(bytes_per_token: int, page_size: int, budget: int) -> int:
    """Pages a budget buys after the dummy page; 0 (not an error) when it buys none, so the
    caller reports the shortfall in terms of one request."""
    try:
        return num_pages_for_budget(bytes_per_token, page_size, budget)
    except InvalidArgumentError:
        return 0
