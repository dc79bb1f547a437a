"""The ``sglang.srt.plugins`` entry point: ``register()`` installs kvplug into SGLang.

SGLang's ``load_plugins()`` calls ``register()`` in every SGLang process (launcher, scheduler,
workers) before server arguments are parsed, then applies the registered hooks. ``register()``:

1. checks the SGLang version (``compat``); an unsupported one installs nothing and logs why;
2. registers every kvplug prefix cache as radix-cache backend ``kvplug:NAME``;
3. registers attention backends ``kvplug`` (kvplug's ``auto``), ``kvplug:NAME`` for each kvplug
   attention backend and ``kvplug:P,D`` for each prefill/decode pair, and adds the single names
   to ``--attention-backend``'s choices;
4. registers the hooks of ``hooks.py`` (CLI arguments, kvplug's KV pool and table, the
   radix-cache names that carry a host-memory tier).

It is idempotent within a process. Set ``SGLANG_PLUGINS`` to a list without ``kvplug`` to keep
SGLang from loading it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import multiprocessing
from typing import Any, Callable

from kvplug.plugins import PluginManager, default_manager

from kvplug_sglang import compat, names

logger = logging.getLogger(__name__)

_installed = False


def register() -> bool:
    """Install kvplug into the running SGLang; returns whether it is installed."""
    global _installed
    if _installed:
        return True
    try:
        version = compat.require_supported_sglang()
    except compat.UnsupportedSGLangError as error:
        logger.error("kvplug-sglang not installed into SGLang: %s", error)
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvplug_sglang.hooks import HOOKS, HTTP_HOOKS
    from kvplug_sglang.radix_backends import register_radix_cache_backends

    caches = register_radix_cache_backends(default_manager)
    attention = register_attention_backends(default_manager)
    in_main_process = multiprocessing.parent_process() is None  # the HTTP server's, not a scheduler's
    for target, hook_type, function in HOOKS + (HTTP_HOOKS if in_main_process else ()):
        HookRegistry.register(target, function, HookType[hook_type])
    _installed = True
    logger.info(
        "kvplug-sglang installed into SGLang %s: radix-cache backends %s; attention backends %s",
        version,
        caches,
        attention,
    )
    return True


def create_attention_backend(model_runner: Any, *, kvplug_attention: str) -> Any:
    """SGLang attention-backend factory for ``--attention-backend kvplug[:NAME]``."""
    from kvplug_sglang.attention_backend import KvplugAttnBackend

    return KvplugAttnBackend(model_runner, kvplug_attention)


def register_attention_backends(manager: Callable[[], PluginManager] = default_manager) -> list[str]:
    """Register the SGLang attention-backend names for kvplug attention; returns them."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    singles = manager().available("attention")
    kvplug_names = [names.DEFAULT_ATTENTION] + [name for name in singles if name != names.DEFAULT_ATTENTION]
    pairs = [f"{prefill},{decode}" for prefill, decode in itertools.permutations(singles, 2)]
    registered = []
    for kvplug_name in kvplug_names + pairs:
        sglang_name = names.attention_backend_name(kvplug_name)
        if sglang_name not in ATTENTION_BACKENDS:
            register_attention_backend(sglang_name)(
                functools.partial(create_attention_backend, kvplug_attention=kvplug_name)
            )
        registered.append(sglang_name)
    choices = [names.attention_backend_name(name) for name in kvplug_names]
    add_attention_backend_choices([choice for choice in choices if choice not in ATTENTION_BACKEND_CHOICES])
    return registered
