"""How kvplug components are named inside SGLang.

Every choice is carried by SGLang's own server-argument fields, so it reaches every SGLang process
(scheduler, TP workers) through SGLang's own pickling of ``ServerArgs``, with no side channel:

- prefix cache ``NAME`` -> ``--radix-cache-backend kvplug:NAME`` (one SGLang radix-cache backend
  is registered per kvplug prefix-cache name, third-party ones included); with a host-memory tier
  of ``B`` bytes -> ``kvplug:NAME+host_memory=B`` (SGLang has no field for it; the registry lookup
  resolves the suffixed name to ``NAME``'s factory with the option, ``hooks.py``); with
  ``--kvplug-on-cache-failure fail`` the suffix ``+on_cache_failure=fail`` follows (the default,
  ``fallback``, is spelled by its absence);
- kvplug attention ``auto`` -> ``--attention-backend kvplug``; any other kvplug attention ``NAME``
  (``torch``, ``triton``, ``flashinfer``, ``fa3``, ``"P,D"``) -> ``--attention-backend kvplug:NAME``.

An attention backend named ``kvplug...`` is also what switches SGLang's KV pool and req-to-token
table to kvplug's (``hooks.py``): kvplug attention reads kvplug's table layout.
"""

from __future__ import annotations

from typing import Iterable, Optional

PREFIX = "kvplug"
SEPARATOR = ":"
DEFAULT_PREFIX_CACHE = "radix"
DEFAULT_ATTENTION = "auto"


HOST_MEMORY_OPTION = "+host_memory="
ON_CACHE_FAILURE_OPTION = "+on_cache_failure="
ON_CACHE_FAILURE_DEFAULT = "fallback"
ON_CACHE_FAILURE_CHOICES = ("fallback", "fail")


def radix_cache_backend_name(
    prefix_cache: str, host_memory: Optional[int] = None, on_cache_failure: Optional[str] = None
) -> str:
    """SGLang ``--radix-cache-backend`` value for kvplug prefix cache ``prefix_cache``, with a
    host-memory tier of ``host_memory`` bytes when given, and ``on_cache_failure`` when it is not
    the default."""
    name = f"{PREFIX}{SEPARATOR}{prefix_cache}"
    if host_memory is not None:
        name = f"{name}{HOST_MEMORY_OPTION}{int(host_memory)}"
    if on_cache_failure not in (None, ON_CACHE_FAILURE_DEFAULT):
        name = f"{name}{ON_CACHE_FAILURE_OPTION}{on_cache_failure}"
    return name


def split_on_cache_failure(radix_cache_backend: str) -> tuple[str, str]:
    """``(backend name without the option, the policy)`` of a ``--radix-cache-backend`` value;
    ``ValueError`` for an unknown policy."""
    base, found, policy = radix_cache_backend.partition(ON_CACHE_FAILURE_OPTION)
    if not found:
        return radix_cache_backend, ON_CACHE_FAILURE_DEFAULT
    if policy not in ON_CACHE_FAILURE_CHOICES:
        raise ValueError(f"expected {base}{ON_CACHE_FAILURE_OPTION}{'|'.join(ON_CACHE_FAILURE_CHOICES)}, "
                         f"got {radix_cache_backend!r}")
    return base, policy


def split_host_memory(radix_cache_backend: str) -> tuple[str, Optional[int]]:
    """``(backend name without the option, host-memory bytes or None)`` of a
    ``--radix-cache-backend`` value (without ``+on_cache_failure=``); ``ValueError`` for a
    malformed byte count."""
    base, found, size = radix_cache_backend.partition(HOST_MEMORY_OPTION)
    if not found:
        return radix_cache_backend, None
    if not size.isdigit() or int(size) <= 0:
        raise ValueError(f"expected {base}{HOST_MEMORY_OPTION}BYTES (a positive integer), got {radix_cache_backend!r}")
    return base, int(size)


def prefix_cache_of(radix_cache_backend: Optional[str]) -> Optional[str]:
    """The kvplug prefix-cache name inside a ``--radix-cache-backend`` value, or ``None``."""
    if radix_cache_backend and radix_cache_backend.startswith(PREFIX + SEPARATOR):
        name = radix_cache_backend[len(PREFIX + SEPARATOR) :].partition(ON_CACHE_FAILURE_OPTION)[0]
        return name.partition(HOST_MEMORY_OPTION)[0]
    return None


def attention_backend_name(kvplug_attention: str) -> str:
    """SGLang ``--attention-backend`` value that runs kvplug attention backend ``kvplug_attention``."""
    if kvplug_attention == DEFAULT_ATTENTION:
        return PREFIX
    return f"{PREFIX}{SEPARATOR}{kvplug_attention}"


def kvplug_attention_of(attention_backend: Optional[str]) -> Optional[str]:
    """The kvplug attention name inside an ``--attention-backend`` value, or ``None``."""
    if attention_backend == PREFIX:
        return DEFAULT_ATTENTION
    if attention_backend and attention_backend.startswith(PREFIX + SEPARATOR):
        return attention_backend[len(PREFIX + SEPARATOR) :]
    return None


def uses_kvplug_attention(attention_backends: Iterable[Optional[str]]) -> bool:
    """True when any of SGLang's attention-backend fields selects a kvplug backend."""
    return any(kvplug_attention_of(name) is not None for name in attention_backends)
