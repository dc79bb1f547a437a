"""kvplug-transformers: HF transformers' continuous batching on kvplug's KV cache.

::

    import kvplug_transformers

    kvplug_transformers.install(prefix_cache="radix", page_size=16)   # process-wide
    outputs = model.generate_batch(prompts, generation_config=generation_config)
    print(kvplug_transformers.stats().describe())

After ``install()``, ``generate_batch``, ``ContinuousBatchingManager`` and ``transformers serve
--continuous-batching`` run with kvplug's pool, allocator and prefix cache, and the
``paged|kvplug`` attention function (kvplug's torch / triton / flashinfer backends). Importing this
package does not import transformers; ``install()`` does, and checks its version
(``SUPPORTED_RANGE``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvplug.lazy_names import lazy_attributes
from kvplug_transformers._version import __version__

if TYPE_CHECKING:
    from kvplug_transformers.host import TransformersHost
    from kvplug_transformers.host_stats import HostStats

# (the statistics module is host_stats, not stats: a submodule named stats would replace the
# package function stats() on import)
# imported on first access: the kvplug entry point (kvplug_transformers.plugin) loads this package
# for every `kvplug` command, which must not import torch for it
_LAZY_NAMES = {
    "ATTENTION_NAME": "kvplug_transformers.attention",
    "SUPPORTED_RANGE": "kvplug_transformers.compat",
    "UnsupportedTransformersError": "kvplug_transformers.compat",
    "TransformersHost": "kvplug_transformers.host",
    "KVPlugSettings": "kvplug_transformers.settings",
    "HostStats": "kvplug_transformers.host_stats",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY_NAMES)

_default_host: TransformersHost | None = None


def default_host() -> TransformersHost:
    """The process-wide host behind ``install`` / ``uninstall`` / ``stats``."""
    global _default_host
    if _default_host is None:
        from kvplug_transformers.host import TransformersHost

        _default_host = TransformersHost()
    return _default_host


def install(**options: Any) -> TransformersHost:
    """Install kvplug into transformers' continuous batching; ``options`` are ``KVPlugSettings`` fields."""
    return default_host().install(**options)


def uninstall() -> None:
    default_host().uninstall()


def stats() -> HostStats:
    return default_host().stats()


__all__ = [
    "ATTENTION_NAME",
    "HostStats",
    "KVPlugSettings",
    "SUPPORTED_RANGE",
    "TransformersHost",
    "UnsupportedTransformersError",
    "__version__",
    "default_host",
    "install",
    "stats",
    "uninstall",
]
