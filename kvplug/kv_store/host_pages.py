"""Host-tier pages as store values: the bytes of one ``HostKVPool`` page, and back.

A host page (``HostKVPool.buffer[h]``, ``[2, L, P, H, D]``: all layers, K and V) is contiguous,
so its value is its raw bytes, handed to the store without a copy; the namespace
(``namespace_for_pool``) records every dimension, the dtype and the tensor-parallel rank, so a
value of another shape never meets this pool under the same key.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvplug.interface.errors import InvalidArgumentError
from kvplug.kv_store.keys import KVNamespace
from kvplug.memory.host_pool import HostKVPool


def namespace_for_pool(model: str, kv_buffer: torch.Tensor, *, tp_rank: int = 0, tp_size: int = 1) -> KVNamespace:
    """The namespace of pages of ``kv_buffer`` (``[2, L, num_pages + 1, P, H, D]``) for ``model``."""
    if not isinstance(kv_buffer, torch.Tensor) or kv_buffer.dim() != 6 or kv_buffer.shape[0] != 2:
        raise InvalidArgumentError(
            f"expected a KV pool buffer [2, num_layers, num_pages + 1, page_size, heads, head_dim], got "
            f"{getattr(kv_buffer, 'shape', type(kv_buffer).__name__)}"
        )
    _, layers, _, page_size, heads, head_dim = kv_buffer.shape
    layout = f"mha:kv-first:L{layers}:H{heads}:D{head_dim}"
    dtype = str(kv_buffer.dtype).removeprefix("torch.")
    return KVNamespace(model, layout, int(page_size), dtype, tp_rank=tp_rank, tp_size=tp_size)


def host_page_payloads(host_pool: HostKVPool, pages: Sequence[int]) -> list[memoryview]:
    """The bytes of host pages ``pages`` (views of the pool's memory: store them before the pages
    are reused)."""
    host_pool.synchronize()  # a queued write-back must have landed before its bytes are read
    return host_page_views(host_pool, pages)


def host_page_views(host_pool: HostKVPool, pages: Sequence[int]) -> list[memoryview]:
    """``host_page_payloads`` without the wait: for a caller that waited for the write that filled
    the pages (``HostKVPool.wait_written``) and keeps them from reuse (``HostPagePins``)."""
    words = host_pool.buffer.view(host_pool.num_pages, -1).view(torch.uint8).numpy()
    return [memoryview(words[_page(host_pool, page)]) for page in pages]


def fill_host_pages(host_pool: HostKVPool, pages: Sequence[int], payloads: Sequence[object]) -> int:
    """Copy ``payloads`` into host pages ``pages``, in order, up to the first payload that is not
    exactly one page of bytes; how many pages were filled (the rest are a miss)."""
    if len(payloads) > len(pages):
        raise InvalidArgumentError(f"{len(payloads)} payloads for {len(pages)} host pages")
    pages = [_page(host_pool, page) for page in pages]  # all checked before any is written
    words = host_pool.buffer.view(host_pool.num_pages, -1).view(torch.uint8).numpy()
    filled = 0
    for page, payload in zip(pages, payloads):
        data = np.frombuffer(payload, dtype=np.uint8)
        if data.size != host_pool.bytes_per_page:
            break
        words[page] = data
        filled += 1
    return filled


def _page(host_pool: HostKVPool, page: int) -> int:
    page = int(page)
    if not 0 <= page < host_pool.num_pages:
        raise InvalidArgumentError(f"host page {page} is outside the host pool's {host_pool.num_pages} pages")
    return page
