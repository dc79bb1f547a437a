"""The functions the plugin attaches to SGLang through ``sglang.srt.plugins.hook_registry``.

``HOOKS`` lists ``(target, hook type, function)``; ``sglang_plugin.register`` registers them and
SGLang's ``load_plugins`` applies them in every process:

- after ``ServerArgs.add_cli_args(parser)``: add ``--kv-backend``, ``--prefix-cache`` and
  ``--kvplug-attention`` (``cli_args``);
- around ``KVCacheConfigurator._resolve_kv_pool_class`` (SGLang's seat for the platform's
  ``get_kv_pool_cls`` hook): the MHA pool class becomes ``KvplugMHATokenToKVPool``; the other
  kinds (MLA, DSA, a page-major or platform MHA pool) become classes that refuse to be built, so
  only a model that really uses one fails, at startup, with an error naming it;
- around ``KVCacheConfigurator._build_default_req_pool``: the table becomes ``KvplugReqToTokenPool``;
- around ``sglang.srt.mem_cache.registry.get_radix_cache_factory`` (what ``create_tree_cache`` looks
  names up with): ``kvplug:NAME+host_memory=BYTES`` (``--kvplug-host-memory``, see ``names.py``)
  resolves to ``kvplug:NAME``'s factory with that host-memory tier; ``+on_cache_failure=fail``
  (``--kvplug-on-cache-failure fail``) likewise passes that policy to the factory;
- after ``SchedulerInternalStateController.get_internal_state`` (what ``/server_info`` reports per
  DP rank): ``internal_states[rank]["kvplug_prefix_cache"]``, the prefix-cache quarantine record of
  a kvplug tree cache (issue 32: a quarantined plugin is visible without reading the log);
- after ``TokenizerManager.__init__``, in the main process only (``HTTP_HOOKS``: the HTTP server's,
  where the scheduler modules are not imported for it): ``health.QuarantineHealth`` on SGLang's
  HTTP ``app``, so ``/health`` reports that record as ``kvplug serve``'s ``/health`` does.
- around ``SchedulerKvEventsPublisher.init_kv_events`` (``--kv-events-config``): with a kvplug tree
  cache, a ``"zmq"`` publisher is ``answering_publisher.AnsweringZmqEventPublisher`` (registered with
  SGLang's ``EventPublisherFactory``): SGLang's, numbered from the server's start time and answering
  each new subscriber with a batch, as ``kvplug serve``'s, so a router sees a restart (issue 27).
- after ``Scheduler._prefetch_kvcache`` (SGLang's own storage prefetch, called for every request
  just before it enters the waiting queue): a kvplug tree cache with a shared KV store
  (``--kvplug-remote-kv``) starts reading the prompt's pages off the scheduler thread
  (``KvplugPrefixCache.prefetch``; issue 30).

The two pool hooks act only when an attention-backend field names a kvplug backend (which is what
``--kv-backend kvplug`` sets); otherwise SGLang builds its own pools untouched.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from kvplug_sglang import names

logger = logging.getLogger(__name__)

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_ATTENTION_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


def kvplug_pools_selected(server_args: Any) -> bool:
    """True when ``server_args`` runs kvplug attention, which reads kvplug's pools."""
    return names.uses_kvplug_attention(getattr(server_args, field, None) for field in _ATTENTION_FIELDS)


def after_add_cli_args(result: Any, parser: Any, *args: Any, **kwargs: Any) -> None:
    from kvplug_sglang.cli_args import add_kvplug_arguments

    add_kvplug_arguments(parser)


def around_resolve_kv_pool_class(original: Callable[..., type], configurator: Any, *args: Any, **kwargs: Any) -> type:
    """SGLang resolves the ``mha``, ``mla`` and ``dsa`` pool classes for every model and then builds
    only the one the model uses: kvplug's class for a plain MHA/GQA pool, and for any other kind a
    class that refuses to be built (``pools.refusing_pool_class``), so a model that really needs
    that pool gets one clear error at startup and every other model never notices."""
    pool_class = original(configurator, *args, **kwargs)
    if not kvplug_pools_selected(configurator.server_args):
        return pool_class
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from kvplug_sglang.pools import KvplugMHATokenToKVPool, refusing_pool_class

    kind = kwargs.get("kind", args[0] if args else None)
    default = kwargs.get("default", args[1] if len(args) > 1 else None)
    if kind == "mha" and pool_class is default and default is MHATokenToKVPool:
        return KvplugMHATokenToKVPool
    return refusing_pool_class(pool_class, kind, model_description(configurator))


def model_description(configurator: Any) -> str:
    """``'PATH' (ARCHITECTURE)`` of the model SGLang is configuring, for error messages."""
    model_config = getattr(configurator, "model_config", None)
    path = getattr(model_config, "model_path", None)
    architectures = getattr(getattr(model_config, "hf_config", None), "architectures", None) or []
    return f"{path!r}" + (f" ({', '.join(architectures)})" if architectures else "")


def around_build_default_req_pool(original: Callable[..., Any], configurator: Any, *args: Any, **kwargs: Any) -> Any:
    pool = original(configurator, *args, **kwargs)
    if not kvplug_pools_selected(configurator.server_args):
        return pool
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from kvplug_sglang.pools import KvplugReqToTokenPool

    if type(pool) is not ReqToTokenPool:
        raise NotImplementedError(f"--kv-backend kvplug cannot replace SGLang's {type(pool).__name__} table")
    replacement = KvplugReqToTokenPool.like(pool)
    del pool  # SGLang's table is dropped; the kvplug one has one more (dummy) row
    return replacement


def around_get_radix_cache_factory(original: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
    factory = original(name, *args, **kwargs)
    if factory is not None or names.prefix_cache_of(name) is None:
        return factory
    rest, on_cache_failure = names.split_on_cache_failure(name)
    base, host_memory = names.split_host_memory(rest)
    factory = original(base, *args, **kwargs) if base != name else None
    if factory is None:
        return None
    return functools.partial(factory, host_memory=host_memory, on_cache_failure=on_cache_failure)


def after_get_internal_state(result: Any, controller: Any, *args: Any, **kwargs: Any) -> Any:
    """Add the kvplug tree cache's quarantine record to the scheduler's internal state."""
    from kvplug_sglang.prefix_cache import KvplugPrefixCache

    tree_cache = getattr(getattr(controller, "scheduler", None), "tree_cache", None)
    if isinstance(tree_cache, KvplugPrefixCache) and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["kvplug_prefix_cache"] = tree_cache.quarantine.as_dict()
    return result


def after_tokenizer_manager_init(result: Any, manager: Any, *args: Any, **kwargs: Any) -> None:
    """The HTTP server's tokenizer manager exists and uvicorn has not started: wrap ``/health``."""
    from kvplug_sglang.health import install_on_http_app

    install_on_http_app(manager)


def around_init_kv_events(
    original: Callable[..., Any], events_publisher: Any, kv_events_config: Any = None, *args: Any, **kwargs: Any
) -> Any:
    """With a kvplug tree cache, a ``"zmq"`` publisher is ``answering_publisher``'s: numbered from the
    start time and answering each new subscriber, so a router sees a restart; another publisher kind
    (``"null"``, one registered by someone else) and SGLang's own caches are left alone."""
    from kvplug_sglang.prefix_cache import KvplugPrefixCache

    if kv_events_config and isinstance(getattr(events_publisher, "tree_cache", None), KvplugPrefixCache):
        from kvplug_sglang.answering_publisher import answering_config

        kv_events_config = answering_config(kv_events_config)
    return original(events_publisher, kv_events_config, *args, **kwargs)


_KV_EVENTS = "sglang.srt.managers.scheduler_components.kv_events_publisher.SchedulerKvEventsPublisher"
_INTERNAL_STATE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"


def after_prefetch_kvcache(result: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """A request is about to enter SGLang's waiting queue: a kvplug tree cache prefetches its
    prompt's store pages (``KvplugPrefixCache.prefetch``); any other tree cache is left alone."""
    from kvplug_sglang.prefix_cache import KvplugPrefixCache

    tree_cache = getattr(scheduler, "tree_cache", None)
    if isinstance(tree_cache, KvplugPrefixCache):
        tree_cache.prefetch(req)
    return result


HOOKS = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", "AFTER", after_add_cli_args),
    (f"{_CONFIGURATOR}._resolve_kv_pool_class", "AROUND", around_resolve_kv_pool_class),
    (f"{_CONFIGURATOR}._build_default_req_pool", "AROUND", around_build_default_req_pool),
    ("sglang.srt.mem_cache.registry.get_radix_cache_factory", "AROUND", around_get_radix_cache_factory),
    (f"{_INTERNAL_STATE}.get_internal_state", "AFTER", after_get_internal_state),
    (f"{_KV_EVENTS}.init_kv_events", "AROUND", around_init_kv_events),
    ("sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache", "AFTER", after_prefetch_kvcache),
)

HTTP_HOOKS = (  # registered in the main process only (sglang_plugin.register)
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__", "AFTER", after_tokenizer_manager_init),
)
