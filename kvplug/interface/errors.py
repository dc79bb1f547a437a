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
