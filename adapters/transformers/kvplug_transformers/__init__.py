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

from typing import Any

from kvplug_transformers._version import __version__
from kvplug_transformers.attention import ATTENTION_NAME
from kvplug_transformers.compat import SUPPORTED_RANGE, UnsupportedTransformersError
from kvplug_transformers.host import TransformersHost
from kvplug_transformers.settings import KVPlugSettings
from kvplug_transformers.stats import HostStats

_default_host: TransformersHost | None = None


def default_host() -> TransformersHost:
    """The process-wide host behind ``install`` / ``uninstall`` / ``stats``."""
    global _default_host
    if _default_host is None:
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
