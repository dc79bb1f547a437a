"""Exception types of the public contract.

Every error kvplug raises on bad input says what was expected and what was given, and is raised
before any structure is modified.
"""

from __future__ import annotations


class KVPlugError(Exception):
    """Base class of every error kvplug raises on purpose."""


class UnknownComponentError(KVPlugError, KeyError):
    """A component name that no loaded plugin registered.

    A ``KeyError`` so that ``except KeyError`` in host code keeps working. The message lists the
    available names and the plugin that provides each.
    """

    def __str__(self) -> str:  # KeyError would repr() the message and add quotes
        return str(self.args[0]) if self.args else ""


class DuplicateComponentError(KVPlugError, ValueError):
    """Two plugins registered the same name for the same kind of component."""


class PluginRegistrationError(KVPlugError, ValueError):
    """A plugin called ``register`` with a bad name or factory, or a factory returned the wrong type."""


class PluginLoadError(KVPlugError, ImportError):
    """An entry-point plugin failed to import while ``KVPLUG_STRICT_PLUGINS=1``."""


class InvalidArgumentError(KVPlugError, ValueError):
    """A tensor or value of the wrong dtype, device, shape or range."""


class OutOfMemoryError(KVPlugError, RuntimeError):
    """The KV pool cannot satisfy an allocation, even after evicting every evictable entry."""


class TierCopyError(KVPlugError, RuntimeError):
    """A copy between the KV pool and the host-memory tier failed (``kvplug.memory.host_pool``).

    Raised before the cache records the copy as done: the tier's structures are unchanged (a
    failed load leaves the prefix host-resident) or the entries the copy was for are dropped (a
    failed write-back), never pointing at bytes that were not copied.
    """


class DeferredWorkError(KVPlugError, RuntimeError):
    """An object holding deferred work (the write-backs one ``evict`` queued, a lazy region's
    frees, a commit's pending token ids, an admission's host-tier loads in flight) was taken a
    second time, by an owner it does not belong to, or dropped without being taken: its work
    would be done twice, for the wrong request, or never. Raised before anything is done;
    nothing changed."""


class PrefixCacheFault(KVPlugError, RuntimeError):
    """A prefix-cache plugin raised, or gave an answer that breaks the contract (a location outside
    the pool or twice, a length that disagrees with its locations, an eviction short of what was
    asked ...), found where kvplug received it (``kvplug.prefix_cache.checked``).

    Raised before kvplug used the answer. A ``KVBackend`` that catches it replaces the cache
    (``on_cache_failure``, ``kvplug.cache_guard``); the message names the plugin, the method and
    what it did.

    Attributes:
        plugin: the cache's name (registered name, else its class).
        method: the ``BasePrefixCache`` member that failed.
    """

    def __init__(self, message: str, *, plugin: str = "", method: str = "") -> None:
        super().__init__(message)
        self.plugin = plugin
        self.method = method


class ConcurrentUseError(KVPlugError, RuntimeError):
    """A ``KVBackend`` was called from a second thread while a call from another thread was still
    running: a backend is driven by one thread at a time; the refused call changed nothing."""


class CacheOwnedError(KVPlugError, RuntimeError):
    """``reset`` or ``evict`` was called directly on a prefix cache a ``KVBackend`` owns: the
    backend's page accounting would break (evicted locations never reach its free list, a reset
    drops pages live requests lock). Use ``KVBackend.reset_prefix_cache`` / ``evict_prefix_cache``."""


class KVStoreError(KVPlugError, RuntimeError):
    """A shared KV store (``kvplug.BaseKVStore``) could not answer: down, too slow, full, refused
    the credentials, or spoke a protocol kvplug does not understand.

    Stores raise it; ``kvplug.kv_store.RemoteKV`` turns it into a miss or a dropped write, counted by
    ``reason``, so it never reaches the serving path. Its message never holds a credential.

    Attributes:
        reason: one of ``REASONS``.
    """

    REASONS = ("unavailable", "timeout", "full", "auth", "protocol")

    def __init__(self, message: str, *, reason: str) -> None:
        if reason not in self.REASONS:
            raise ValueError(f"KVStoreError reason must be one of {self.REASONS}, got {reason!r}")
        super().__init__(message)
        self.reason = reason
