"""Every kvplug prefix cache as an SGLang radix-cache backend: ``--radix-cache-backend kvplug:NAME``.

``register_radix_cache_backends()`` registers one SGLang backend per name kvplug's plugin manager
knows (built-ins and third-party plugins alike) through SGLang's
``register_radix_cache_backend(name, factory)``. SGLang's ``create_tree_cache`` calls the factory
with its ``TreeCacheBuildContext`` in the scheduler process; the factory refuses model kinds a
kvplug prefix cache cannot hold (hybrid SWA, Mamba, DSA, hierarchical cache) with an error that
names them, and otherwise returns a ``KvplugPrefixCache``.

With a host-memory tier (``--kvplug-host-memory SIZE``, which ``--kv-backend kvplug`` spells
``--radix-cache-backend kvplug:NAME+host_memory=BYTES``) the default namespace's cache is created
with the option ``host_memory`` and must be a ``BaseTieredPrefixCache``; it is attached to the
KV pool's storage (``KvplugMHATokenToKVPool.kvplug_pool``), which only ``--kv-backend kvplug``
builds: over SGLang's own pools the factory refuses. Other namespaces (LoRA adapters, cache
salts) get device-only caches, so the tier's host memory is allocated once, at startup.

With ``--kvplug-remote-kv URL`` (published in the environment, ``remote_kv``) the default
namespace's tiered cache also gets the shared KV store, keyed by the served model's name.

A cache whose class is not ``trusted`` (a third-party plugin) is built inside a
``CheckedPrefixCache`` over the pool SGLang's allocator hands out (``allocator.size // page_size``
pages plus page 0, SGLang's padding page), a ``CheckedTieredPrefixCache`` for one with a host tier,
so its faults are quarantined (``quarantine``) as in ``KVBackend``. ``on_cache_failure`` (``--kvplug-on-cache-failure``,
spelled ``+on_cache_failure=fail`` in the backend name) picks the policy.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import torch

from kvplug.cache_guard import checked
from kvplug.interface import BaseTieredPrefixCache
from kvplug.plugins import PluginManager, default_manager

from kvplug_sglang import names, quarantine, remote_kv
from kvplug_sglang.cache_spaces import DEFAULT_NAMESPACE

logger = logging.getLogger(__name__)


def build_prefix_cache(
    ctx: Any,
    *,
    name: str,
    manager: Optional[Callable[[], PluginManager]] = None,
    host_memory: Optional[int] = None,
    on_cache_failure: str = names.ON_CACHE_FAILURE_DEFAULT,
) -> Any:
    """SGLang radix-cache factory: ``ctx`` is SGLang's ``TreeCacheBuildContext``; ``host_memory``:
    bytes of the host-memory tier (``None``: none); ``on_cache_failure``: ``"fallback"`` or
    ``"fail"`` for an untrusted cache that faults."""
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

    kv_pool = _kvplug_kv_pool(params, name) if host_memory is not None else None
    store_url = remote_kv.published()
    if store_url is not None and kv_pool is None:
        raise ValueError(
            f"{remote_kv.FLAG} {remote_kv.shown(store_url)} sits under the host-memory tier: expected "
            f"--radix-cache-backend {names.radix_cache_backend_name(name)}{names.HOST_MEMORY_OPTION}BYTES, got "
            f"--radix-cache-backend {names.radix_cache_backend_name(name)}"
        )
    store = {} if store_url is None else {"remote_kv": store_url, "remote_kv_model": remote_kv.model_id(ctx.server_args)}
    num_pages = pool_pages(params.token_to_kv_pool_allocator, params.page_size)

    def new_cache(namespace):
        if kv_pool is None or namespace != DEFAULT_NAMESPACE:
            cache = get_manager().create_prefix_cache(name, device="cpu", page_size=params.page_size, **options)
            return checked(cache, name, num_pages, params.page_size)
        cache = get_manager().create_prefix_cache(
            name, device="cpu", page_size=params.page_size, host_memory=host_memory, **store, **options
        )
        if not isinstance(cache, BaseTieredPrefixCache):
            raise ValueError(
                f"--kvplug-host-memory: kvplug prefix cache {name!r} has no host-memory tier "
                f"(it built a {type(cache).__name__}); use --prefix-cache radix"
            )
        cache = checked(cache, name, num_pages, params.page_size)  # a CheckedTieredPrefixCache when untrusted
        cache.attach_kv_pool(kv_pool)
        _log_tier(cache, host_memory, store_url)
        return cache

    def fallback():
        return get_manager().create_prefix_cache(quarantine.FALLBACK, device="cpu", page_size=params.page_size)

    cache = KvplugPrefixCache(
        params, new_cache, name, fence_stream=_forward_stream(ctx) if kv_pool is not None else None,
        on_cache_failure=on_cache_failure, fallback=fallback,
    )
    logger.info("kvplug-sglang: tree cache is kvplug prefix cache %r (page size %d)", name, params.page_size)
    return cache


def pool_pages(allocator: Any, page_size: int) -> int:
    """Pages a checked cache may be given: SGLang's allocator hands out pages ``1 ..
    allocator.size // page_size`` (page 0 is its padding page, counted so that locations start at 0)."""
    return int(allocator.size) // page_size + 1


def _kvplug_kv_pool(params: Any, name: str) -> Any:
    """The kvplug KV pool under SGLang's allocator; a host tier copies pages of it."""
    get_kvcache = getattr(params.token_to_kv_pool_allocator, "get_kvcache", None)
    pool = getattr(get_kvcache() if get_kvcache else None, "kvplug_pool", None)
    if pool is None:
        raise ValueError(
            f"a host-memory tier (--kvplug-host-memory) for --radix-cache-backend {names.radix_cache_backend_name(name)} "
            "needs kvplug's KV pool: add --kv-backend kvplug (over SGLang's own pools, "
            "--radix-cache-backend kvplug:NAME has no host tier)"
        )
    return pool


def _forward_stream(ctx: Any) -> Any:
    """The CUDA stream SGLang's forwards run on under the overlap scheduler, or ``None``."""
    stream = getattr(getattr(getattr(ctx, "tp_worker", None), "model_runner", None), "forward_stream", None)
    return stream if isinstance(stream, torch.cuda.Stream) else None


def _log_tier(cache: BaseTieredPrefixCache, host_memory: int, store_url: Optional[str]) -> None:
    stats = cache.tier_stats()
    pool = cache.host_pool
    logger.info(
        "kvplug-sglang: host-memory tier of %s bytes (--kvplug-host-memory): %d host pages of %d tokens, "
        "%s bytes each, %s bytes in all, %s; write-back on eviction, loaded on admission",
        f"{host_memory:,}",
        stats.host_pages,
        stats.page_size,
        f"{pool.bytes_per_page:,}",
        f"{stats.host_pages * pool.bytes_per_page:,}",
        "pinned" if pool.pinned else "not pinned",
    )
    if store_url is not None:
        logger.info("kvplug-sglang: shared KV store %s under the host tier (%s)", remote_kv.shown(store_url), remote_kv.FLAG)


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
