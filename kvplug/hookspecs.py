"""pluggy hook specifications of the ``kvplug`` project (docs/design.md, section 3).

Each hook receives a ``register`` callback. A plugin calls ``register(name, factory)`` once per
component it provides; ``name`` is a non-empty string unique within its kind across all plugins.
pluggy lets an implementation omit arguments it does not use (``def kvplug_register_hosts(): ...``
is valid) but rejects one that names an argument the spec does not have.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

PROJECT_NAME = "kvplug"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, Callable[..., Any]], None]


@hookspec
def kvplug_register_prefix_caches(register: Register) -> None:
    """Register prefix caches: ``register(name, factory)`` with
    ``factory(config: kvplug.PrefixCacheConfig) -> kvplug.BasePrefixCache``."""


@hookspec
def kvplug_register_kv_pools(register: Register) -> None:
    """Register KV pools: ``register(name, factory)`` with
    ``factory(config: kvplug.KVPoolConfig) -> kvplug.BaseKVPool``."""


@hookspec
def kvplug_register_attention_backends(register: Register) -> None:
    """Register attention backends: ``register(name, factory)`` with
    ``factory(config: kvplug.AttentionConfig) -> kvplug.BaseAttentionBackend``."""


@hookspec
def kvplug_register_hosts(register: Register) -> None:
    """Register host adapters: ``register(name, factory)`` with ``factory(**options)`` returning
    the adapter object a host engine installs (see ``adapters/``). An adapter object that also has
    ``e2e_bench()`` (returning a ``kvplug.bench.e2e_host.E2EHost``) can run ``kvplug bench e2e``."""


@hookspec
def kvplug_register_kv_stores(register: Register) -> None:
    """Register shared KV stores (issue 30, additive): ``register(name, factory)`` with
    ``factory(config: kvplug.KVStoreConfig) -> kvplug.BaseKVStore``; ``name`` is the URL scheme
    that selects it (``redis`` for ``redis://...``)."""
