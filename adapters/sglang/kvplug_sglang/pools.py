"""kvplug's pools in SGLang's pool classes: the KV storage and the req-to-token table.

``KvplugMHATokenToKVPool`` is SGLang's ``MHATokenToKVPool`` whose per-layer K/V buffers are views of
one kvplug ``mha`` pool (``[2, layers, pages + 1, page_size, heads, head_dim]``). SGLang's token
locations and kvplug's coincide: SGLang allocates ``size + page_size`` rows per layer (slot 0's
page absorbs padded writes) and the kvplug pool is built with ``size / page_size`` pages plus its
one extra page, the same number of rows. Everything else (addressing, ``set_kv_buffer``, transfer
descriptors) stays SGLang's; only ``_create_buffers_normal`` (the plain-layout allocation) differs.

``KvplugReqToTokenPool`` is SGLang's ``ReqToTokenPool`` with kvplug's table layout: one more row at
the end, never handed to a request, which kvplug's batch builder reserves for the dummy (padding)
request. SGLang's own padding row 0 stays as it is; the dummy row points at SGLang's padding slot 0.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from kvplug.interface import BaseKVPool, KVPlugError, KVPoolConfig
from kvplug.plugins import PluginManager, default_manager
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

#: kvplug KV-pool name the SGLang pool is carved from
KV_POOL_NAME = "mha"


class KvplugMHATokenToKVPool(MHATokenToKVPool):
    """SGLang MHA KV pool whose storage is a kvplug pool (``self.kvplug_pool``).

    Built by SGLang's ``KVCacheConfigurator`` with ``MHATokenToKVPool``'s own arguments.
    """

    kvplug_manager: Callable[[], PluginManager] = staticmethod(default_manager)
    kvplug_pool: BaseKVPool

    def _create_buffers(self) -> None:
        # SGLang's other allocation paths would bypass kvplug's storage without a word
        if self.is_quantized_kv_cache or self.post_capture_active:
            feature = "a quantized (FP8/FP4) KV cache" if self.is_quantized_kv_cache else "post-capture KV backing"
            raise NotImplementedError(f"kvplug's KV pool does not support {feature}")
        super()._create_buffers()

    def _create_buffers_normal(self) -> None:
        unsupported = []
        if self.kv_cache_layout != "nhd":
            unsupported.append(f"KV layout {self.kv_cache_layout!r} (kvplug stores token-major NHD)")
        if self.v_head_dim != self.head_dim:
            unsupported.append(f"V head dim {self.v_head_dim} != K head dim {self.head_dim}")
        rows = self.size + self.page_size
        if rows % self.page_size:
            unsupported.append(f"pool size {self.size} not a multiple of the page size {self.page_size}")
        if unsupported:
            raise NotImplementedError(f"kvplug's KV pool cannot serve this model: {'; '.join(unsupported)}")
        device = torch.device(self.device)
        config = KVPoolConfig(
            num_layers=self.layer_num,
            num_kv_heads=self.head_num,  # already this rank's share
            head_dim=self.head_dim,
            num_pages=rows // self.page_size - 1,
            page_size=self.page_size,
            dtype=self.store_dtype,
            device=device,
            # the location range check reads the device: keep it to CPU pools
            options={"validate": device.type == "cpu"},
        )
        self.kvplug_pool = type(self).kvplug_manager().create_kv_pool(KV_POOL_NAME, config)
        shape = (rows, self.head_num, self.head_dim)
        self.k_buffer = [self.kvplug_pool.k_cache(layer).view(shape) for layer in range(self.layer_num)]
        self.v_buffer = [self.kvplug_pool.v_cache(layer).view(shape) for layer in range(self.layer_num)]
        logger.info(
            "kvplug-sglang: KV pool is kvplug %r: %d layers x %d rows x %d heads x %d dims, %s",
            KV_POOL_NAME,
            self.layer_num,
            rows,
            self.head_num,
            self.head_dim,
            self.store_dtype,
        )


class UnsupportedKVPoolError(KVPlugError, NotImplementedError):
    """The model needs an SGLang KV pool kvplug does not provide (MLA, DSA, page-major, ...)."""


def refusing_pool_class(pool_class: type, kind: str, model: str) -> type:
    """A subclass of ``pool_class`` whose construction raises ``UnsupportedKVPoolError``.

    SGLang's configurator resolves a class for every pool kind before it knows which one the model
    needs; returning this instead of raising lets models that never build it (every MHA/GQA
    model) start, while one that does gets the error when SGLang builds the pool, at startup.
    """

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedKVPoolError(
            f"--kv-backend kvplug cannot serve model {model}: it needs SGLang's {pool_class.__name__} "
            f"({kind!r} KV pool), and kvplug provides MHA/GQA KV pools only (kvplug pool {KV_POOL_NAME!r}, "
            "token-major NHD, bf16/fp16/fp32). Serve it without --kv-backend kvplug, or keep SGLang's own "
            "pools and attention with --radix-cache-backend kvplug:NAME for a kvplug prefix cache"
        )

    name = f"KvplugRefused{pool_class.__name__}"
    return type(name, (pool_class,), {"__init__": refuse, "__doc__": f"{pool_class.__name__}, refused by kvplug."})


class KvplugReqToTokenPool(ReqToTokenPool):
    """SGLang's req-to-token table plus kvplug's dummy row (the last one, ``dummy_row``).

    Args: as ``ReqToTokenPool`` (``size`` requests, rows ``1..size``; row 0 is SGLang's padding row).
    """

    def __init__(self, size: int, max_context_len: int, device: str, enable_memory_saver: bool) -> None:
        super().__init__(size + 1, max_context_len, device, enable_memory_saver)
        self.size = size
        self.dummy_row = size + 1
        self._reserve_dummy_row()
        self.req_to_token[self.dummy_row].fill_(0)  # SGLang's padding slot absorbs dummy writes

    @classmethod
    def like(cls, pool: ReqToTokenPool, **overrides: Any) -> "KvplugReqToTokenPool":
        """A kvplug table shaped like SGLang's ``pool`` (which the caller drops)."""
        arguments = dict(
            size=pool.size, max_context_len=pool.max_context_len, device=pool.device, enable_memory_saver=False
        )
        arguments.update(overrides)
        return cls(**arguments)

    def clear(self) -> None:
        super().clear()
        self._reserve_dummy_row()

    def _reserve_dummy_row(self) -> None:
        if self.dummy_row in self.free_slots:
            self.free_slots.remove(self.dummy_row)
