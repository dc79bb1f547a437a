"""``build_parts``: assembling a ``KVBackend``'s components from a model shape and sizes (the
facade, ``kvplug.backend``, wires them; this module never imports it)."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from kvplug.devices import resolve_device
from kvplug.interface import (
    AttentionConfig,
    BaseAttentionBackend,
    BaseKVPool,
    BasePrefixCache,
    BaseTieredPrefixCache,
    InvalidArgumentError,
    KVPlugError,
    KVPoolConfig,
    OutOfMemoryError,
)
from kvplug.cache_guard import guarded_cache
from kvplug.memory.allocator import PagedAllocator
from kvplug.memory.capacity import num_pages_for_budget, parse_memory_size
from kvplug.memory.model_shape import ModelShape, parse_dtype
from kvplug.memory.page_table import PageTable
from kvplug.memory.tensor_parallel import local_kv_heads, local_qo_heads

logger = logging.getLogger("kvplug.backend")


@dataclass(frozen=True)
class BackendParts:
    """The components a ``KVBackend`` wires together."""

    shape: ModelShape
    pool: BaseKVPool
    tables: PageTable
    allocator: PagedAllocator
    prefix_cache: BasePrefixCache
    attention: BaseAttentionBackend | None
    attention_name: str | None
    cache_guard: Any = None  # issue 32: kvplug.cache_guard.CacheGuard (None: a guard that raises)


def resolve_attention(name: str, device: torch.device, available: list[str]) -> str:
    """``auto``: flashinfer if importable on CUDA, else triton on CUDA, else torch."""
    if name != "auto":
        return name
    chosen = "torch"
    if device.type == "cuda":
        for candidate, module in (("flashinfer", "flashinfer"), ("triton", "triton")):
            if candidate in available and importlib.util.find_spec(module) is not None:
                chosen = candidate
                break
    logger.debug("attention='auto' on %s resolved to %r", device, chosen)
    return chosen


def build_parts(
    model_config: Any,
    *,
    page_size: int,
    num_pages: int | None,
    memory_budget: int | str | None,
    max_running_reqs: int,
    max_seq_len: int,
    prefix_cache: Any,
    attention: str | None,
    device: str | torch.device,
    dtype: torch.dtype | str | None,
    tp_size: int,
    tp_rank: int,
    manager: Any,
    validate: bool | None,
    attention_options: Mapping[str, Any] | None,
    prefix_cache_options: Mapping[str, Any] | None = None,
    on_cache_failure: str = "fallback",
    fallback_prefix_cache: str = "naive",
) -> BackendParts:
    from kvplug.plugins import default_manager

    manager = manager or default_manager()
    shape = model_config if isinstance(model_config, ModelShape) else ModelShape.from_hf_config(model_config)
    kv_dtype = shape.dtype if dtype is None else parse_dtype(dtype)
    device = resolve_device(device, require_available=True)
    kv_heads = local_kv_heads(shape.num_kv_heads, tp_size)
    qo_heads = local_qo_heads(shape.num_qo_heads, tp_size)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InvalidArgumentError(f"page_size must be a positive int, got {page_size!r}")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise InvalidArgumentError(f"tp_rank must be an int in [0, tp_size={tp_size}), got {tp_rank!r}")
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise InvalidArgumentError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    if isinstance(max_running_reqs, bool) or not isinstance(max_running_reqs, int) or max_running_reqs < 1:
        raise InvalidArgumentError(f"max_running_reqs must be a positive int, got {max_running_reqs!r}")
    num_pages = _num_pages(shape, kv_dtype, page_size, tp_size, num_pages, memory_budget)
    if attention is not None and not isinstance(attention, str):
        raise InvalidArgumentError(f"attention must be a backend name or None, got {attention!r}")
    # prefix caches keep host data whatever the pool's device (SPEC section 3): matching,
    # inserting and evicting never wait for the device
    cache = _prefix_cache(prefix_cache, manager, page_size, prefix_cache_options or {})
    # issue 32 seam: an untrusted cache is checked, and a guard replaces it when it faults
    cache, guard = guarded_cache(cache, prefix_cache, manager, torch.device("cpu"), page_size, num_pages,
                                 prefix_cache_options or {}, on_cache_failure, fallback_prefix_cache)

    pool_options = {"validate": device.type != "cuda" if validate is None else bool(validate)}
    pool_config = KVPoolConfig(
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        num_pages=num_pages,
        page_size=page_size,
        dtype=kv_dtype,
        device=device,
        tp_size=tp_size,
        tp_rank=tp_rank,
        options=pool_options,
    )
    try:
        pool = manager.create_kv_pool("mha", pool_config)
        tables = PageTable(max_running_reqs, max_seq_len, dummy_location=pool.dummy_location, device=pool.device)
    except (RuntimeError, MemoryError) as error:  # torch's allocation failures (CPU and CUDA)
        if isinstance(error, KVPlugError):
            raise
        raise OutOfMemoryError(
            f"cannot allocate the KV pool ({num_pages:,} pages x {page_size} tokens, {shape.num_layers} layers) "
            f"and tables ({max_running_reqs + 1} rows x {max_seq_len} tokens) on {device}: "
            f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        ) from error
    if isinstance(cache, BaseTieredPrefixCache) and getattr(cache, "host_pool", None) is None:
        cache.attach_kv_pool(pool)  # the host tier's page pool is sized from the KV pool's pages
    allocator = PagedAllocator(num_pages, page_size, tables, cache)

    backend, name = None, None
    if attention is not None:
        name = resolve_attention(attention, device, manager.available("attention"))
        config = AttentionConfig(
            pool=pool,
            page_table=tables.table,
            num_qo_heads=qo_heads,
            num_kv_heads=kv_heads,
            head_dim=shape.head_dim,
            options=attention_options or {},
        )
        backend = manager.create_attention_backend(name, config)
    logger.debug(
        "kvplug backend: %d pages x %d tokens on %s (%s), prefix cache %s, attention %s",
        num_pages, page_size, device, kv_dtype, type(cache).__name__, name,
    )
    return BackendParts(shape, pool, tables, allocator, cache, backend, name, guard)


def remote_kv_options(
    prefix_cache: Any, options: Mapping[str, Any] | None, remote_kv: Any, remote_kv_model: Any
) -> Mapping[str, Any] | None:
    """``create_backend``'s ``remote_kv`` / ``remote_kv_model`` folded into the radix cache's
    options (issue 30): the store sits under the host tier, so it is refused without one, and the
    message never repeats a URL's password."""
    if remote_kv is None:
        if remote_kv_model is not None:
            raise InvalidArgumentError(f"remote_kv_model={remote_kv_model!r} is given without remote_kv")
        return options
    given = _describe_store(remote_kv)
    if prefix_cache != "radix":
        shown = prefix_cache if isinstance(prefix_cache, str) else type(prefix_cache).__name__
        raise InvalidArgumentError(
            f"remote_kv={given} is read and written by the radix cache's host tier: expected "
            f"prefix_cache='radix', got {shown!r}"
        )
    options = dict(options or {})
    if options.get("host_memory") is None:
        raise InvalidArgumentError(
            f"remote_kv={given} sits under the host-memory tier: expected prefix_cache_options with "
            f"'host_memory' (e.g. {{'host_memory': '32GiB'}}), got prefix_cache_options={_options_keys(options)}"
        )
    if options.get("remote_kv") is not None or options.get("remote_kv_model") is not None:
        raise InvalidArgumentError(
            f"remote_kv={given} is given twice: expected it either as create_backend's keyword or in "
            f"prefix_cache_options, got both (prefix_cache_options={_options_keys(options)})"
        )
    if not isinstance(remote_kv_model, str) or not remote_kv_model:
        raise InvalidArgumentError(
            f"remote_kv={given} needs remote_kv_model, the model's identity in the store's keys: expected a "
            f"non-empty str, got {remote_kv_model!r}"
        )
    options["remote_kv"], options["remote_kv_model"] = remote_kv, remote_kv_model
    return options


def _describe_store(store: Any) -> str:
    """A store argument as an error message may show it (``***@`` for credentials)."""
    if isinstance(store, str):
        from kvplug.interface.kv_store import redact_url

        return repr(redact_url(store))
    return f"<{type(store).__name__}>"


def _options_keys(options: Mapping[str, Any]) -> str:
    """The options' names, not their values (a value may be a URL with a password)."""
    return "{" + ", ".join(repr(key) for key in options) + "}"


def _num_pages(
    shape: ModelShape, dtype: torch.dtype, page_size: int, tp_size: int, num_pages: int | None, budget: Any
) -> int:
    if (num_pages is None) == (budget is None):
        raise InvalidArgumentError(
            f"give exactly one of num_pages and memory_budget, got num_pages={num_pages!r}, memory_budget={budget!r}"
        )
    if num_pages is not None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise InvalidArgumentError(f"num_pages must be a positive int, got {num_pages!r}")
        return num_pages
    sized = ModelShape(shape.num_layers, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, dtype)
    return num_pages_for_budget(sized.kv_bytes_per_token(tp_size), page_size, parse_memory_size(budget))


def _prefix_cache(spec: Any, manager: Any, page_size: int, options: Mapping[str, Any]) -> BasePrefixCache:
    if isinstance(spec, BasePrefixCache):
        if options:
            raise InvalidArgumentError(f"prefix_cache_options {dict(options)} need a prefix cache name, got an instance")
        cache_device = getattr(spec, "device", None)
        if cache_device is not None and torch.device(cache_device).type != "cpu":
            raise InvalidArgumentError(
                f"prefix cache instances keep host data: build it with device='cpu', got one on {cache_device}"
            )
        cache_page_size = getattr(spec, "page_size", page_size)
        if cache_page_size != page_size:
            raise InvalidArgumentError(f"prefix cache page_size {cache_page_size} != backend page_size {page_size}")
        return spec
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"prefix_cache must be a registered name or a BasePrefixCache, got {spec!r}")
    return manager.create_prefix_cache(spec, device="cpu", page_size=page_size, **options)
