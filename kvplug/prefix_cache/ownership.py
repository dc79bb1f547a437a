"""A prefix cache owned by a ``KVBackend``: its ``reset`` and ``evict`` refused from outside.

The backend's page accounting counts on every location the cache gives back reaching its free
list, and on locked prefixes staying cached while requests use them. ``evict`` called on the
cache directly hands locations to nobody (they leak); ``reset`` drops pages live requests lock.
While a backend owns a cache, those two members of the instance refuse calls made outside the
backend's own calls (``CacheOwnedError``, naming the backend methods that do it safely). The
gate is put on the instance (an attribute shadowing the class's method), so it covers any
cache class, a plugin's or a built-in, without changing it; ``release`` takes it off.
"""

from __future__ import annotations

from typing import Any, Callable

from kvplug.interface import BasePrefixCache, CacheOwnedError

GATED = {"reset": "KVBackend.reset_prefix_cache()", "evict": "KVBackend.evict_prefix_cache(tokens)"}


def take_ownership(cache: BasePrefixCache, inside_backend: Callable[[], bool]) -> None:
    """Gate ``cache.reset`` and ``cache.evict``: they run only while ``inside_backend()`` is true
    (the calling thread is inside a call of the owning backend)."""
    state = getattr(cache, "__dict__", None)
    if state is None:  # a cache class with __slots__: cannot be gated, left as it is
        return
    if state.get("_kvplug_owned") is not None:
        raise CacheOwnedError(f"prefix cache {cache!r} is already owned by another KVBackend")
    for name, instead in GATED.items():
        state[name] = _gated(cache, name, getattr(type(cache), name), instead, inside_backend)
    state["_kvplug_owned"] = inside_backend


def release(cache: BasePrefixCache) -> None:
    """Take the gate off (the backend no longer uses ``cache``)."""
    state = getattr(cache, "__dict__", None)
    if state is None or state.pop("_kvplug_owned", None) is None:
        return
    for name in GATED:
        state.pop(name, None)


def is_owned(cache: BasePrefixCache) -> bool:
    return getattr(cache, "__dict__", {}).get("_kvplug_owned") is not None


def _gated(cache: Any, name: str, method: Callable, instead: str, inside_backend: Callable[[], bool]) -> Callable:
    def gated(*args: Any, **kwargs: Any) -> Any:
        if not inside_backend():
            raise CacheOwnedError(
                f"{type(cache).__name__}.{name}() called directly on a prefix cache a KVBackend owns: the backend's "
                f"page accounting would break (evicted locations would never reach its free list; a reset drops "
                f"pages live requests lock); call {instead} instead"
            )
        return method(cache, *args, **kwargs)

    gated.__name__ = name
    gated.__doc__ = method.__doc__
    return gated
