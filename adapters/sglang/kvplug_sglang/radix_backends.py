"""Every kvplug prefix cache as an SGLang radix-cache backend: ``--radix-cache-backend kvplug:NAME``.

``register_radix_cache_backends()`` registers one SGLang backend per name kvplug's plugin manager
knows (built-ins and third-party plugins alike) through SGLang's
``register_radix_cache_backend(name, factory)``. SGLang's ``create_tree_cache`` calls the factory
with its ``TreeCacheBuildContext`` in the scheduler process; the factory refuses model kinds a
kvplug prefix cache cannot hold (hybrid SWA, Mamba, DSA, hierarchical cache) with an error that
names them, and otherwise returns a ``KvplugPrefixCache``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

from kvplug.plugins import PluginManager, default_manager

from kvplug_sglang import names

logger = logging.getLogger(__name__)


def build_prefix_cache(ctx: Any, *, name: str, manager: Optional[Callable[[], PluginManager]] = None) -> Any:
    """SGLang radix-cache factory: ``ctx`` is SGLang's ``TreeCacheBuildContext``."""
    from kvplug_sglang.prefix_cache import KvplugPrefixCache

    unsupported = [
        label
        for label, flag in (
            ("hybrid sliding-window attention", ctx.is_hybrid_swa),
            ("Mamba / linear-attention state", ctx.is_hybrid_ssm),
            ("DSA sparse attention", getattr(ctx, "is_dsa", False)),
            ("the hierarchical cache (--enable-hierarchical-cache)", ctx.enable_hierarchical_cache),
        )
        if flag
    ]
    if unsupported:
        raise NotImplementedError(
            f"--radix-cache-backend {names.radix_cache_backend_name(name)}: kvplug prefix caches hold "
            f"full-attention KV only; this server uses {', '.join(unsupported)}"
        )
    params = ctx.params
    get_manager = manager or default_manager

    # kvplug's radix is strict LRU; SGLang also refreshes the unused tail of an edge it splits.
    # Ask radix for SGLang's order so that both caches evict the same locations.
    options = {"split_refreshes_tail": True} if name == "radix" else {}

    def new_cache():
        return get_manager().create_prefix_cache(name, device="cpu", page_size=params.page_size, **options)

    cache = KvplugPrefixCache(params, new_cache, name)
    logger.info("kvplug-sglang: tree cache is kvplug prefix cache %r (page size %d)", name, params.page_size)
    return cache


def register_radix_cache_backends(manager: Callable[[], PluginManager] = default_manager) -> list[str]:
    """Register ``kvplug:NAME`` for every kvplug prefix cache not registered yet; returns the new names."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    existing = set(registered_radix_cache_backends())
    added = []
    for name in manager().available("prefix_cache"):
        backend = names.radix_cache_backend_name(name)
        if backend in existing:
            continue
        register_radix_cache_backend(backend, functools.partial(build_prefix_cache, name=name, manager=manager))
        added.append(backend)
    return added
