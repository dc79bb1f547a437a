"""``PluginManager``: kvplug's wrapper around pluggy, owning the built-in and third-party plugins.

Nothing here is global: every host or test can build its own manager. ``kvplug.available`` and
friends use a lazily built default one (``default_manager()``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import pluggy

from kvplug import hookspecs
from kvplug._version import __version__
from kvplug.interface import (
    AttentionConfig,
    BaseAttentionBackend,
    BaseKVPool,
    BasePrefixCache,
    KVPoolConfig,
    PluginRegistrationError,
    PrefixCacheConfig,
)
from kvplug.plugins.kinds import COMPONENT_KINDS, get_kind
from kvplug.plugins.loading import LoadFailure, load_entry_points
from kvplug.plugins.registry import ComponentRegistry

BUILTIN_PLUGINS = (
    "kvplug.builtin.prefix_caches",
    "kvplug.builtin.kv_pools",
    "kvplug.builtin.attention",
)


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin as ``kvplug plugins`` shows it."""

    name: str
    distribution: str
    version: str
    file: str | None
    builtin: bool
    provides: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "file": self.file,
            "builtin": self.builtin,
            "provides": self.provides,
        }


class PluginManager:
    """Registers plugins and builds components by kind and name.

    Args:
        builtins: register kvplug's built-in components (they are plugins too).
        entry_points: load the ``kvplug`` entry-point group now.
        env: environment for ``KVPLUG_*`` variables; ``os.environ`` by default.
    """

    def __init__(self, *, builtins: bool = True, entry_points: bool = True, env: Mapping[str, str] | None = None):
        self._pluggy = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pluggy.add_hookspecs(hookspecs)
        self._origins: dict[str, tuple[str, str, bool]] = {}
        self._registry: ComponentRegistry | None = None
        self.load_failures: list[LoadFailure] = []
        if builtins:
            for module_name in BUILTIN_PLUGINS:
                self.register(importlib.import_module(module_name), module_name, builtin=True)
        if entry_points:
            self.load_entry_points(env)

    @property
    def pluggy_manager(self) -> pluggy.PluginManager:
        return self._pluggy

    def register(
        self,
        plugin: Any,
        name: str | None = None,
        *,
        distribution: str | None = None,
        version: str | None = None,
        builtin: bool = False,
    ) -> str:
        """Register a plugin object (module, class or instance with ``@kvplug.hookimpl`` functions).

        Raises ``pluggy.PluginValidationError`` for a hook implementation whose name starts with
        ``kvplug_`` but matches no hook, or that takes an argument its hook does not offer.
        """
        plugin_name = name or self._pluggy.get_canonical_name(plugin)
        try:
            registered = self._pluggy.register(plugin, plugin_name)
            self._pluggy.check_pending()
        except pluggy.PluginValidationError:
            # pluggy keeps a half-registered plugin after a validation error: drop it
            if self._pluggy.has_plugin(plugin_name):
                self._pluggy.unregister(name=plugin_name)
            raise
        if registered is None:
            raise PluginRegistrationError(f"plugin {plugin_name!r} is blocked or already registered")
        if builtin:
            distribution, version = "kvplug", __version__
        self._origins[registered] = (distribution or "unknown", version or "unknown", builtin)
        self._registry = None
        return registered

    def unregister(self, name: str) -> None:
        self._pluggy.unregister(name=name)
        self._origins.pop(name, None)
        self._registry = None

    def load_entry_points(self, env: Mapping[str, str] | None = None) -> list[LoadFailure]:
        """Load the ``kvplug`` entry-point group (see ``kvplug.plugins.loading``)."""

        def register(plugin: Any, name: str, distribution: str, version: str) -> None:
            if self._pluggy.has_plugin(name):
                return
            self.register(plugin, name, distribution=distribution, version=version)

        failures = load_entry_points(register, os.environ if env is None else env)
        self.load_failures.extend(failures)
        return failures

    @property
    def registry(self) -> ComponentRegistry:
        if self._registry is None:
            self._registry = ComponentRegistry.collect(self._pluggy, COMPONENT_KINDS.values())
        return self._registry

    def available(self, kind: str) -> list[str]:
        """Registered names for ``kind`` (``prefix_cache``, ``kv_pool``, ``attention``, ``host``)."""
        return self.registry.names(get_kind(kind).name)

    def providers(self, kind: str) -> dict[str, str]:
        """Name → providing plugin, for ``kind``."""
        return {entry.name: entry.plugin for entry in self.registry.entries(get_kind(kind).name)}

    def create(self, kind: str, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the factory registered as ``name`` for ``kind`` and check what it returns."""
        component_kind = get_kind(kind)
        if not isinstance(name, str):
            raise TypeError(f"{kind} name must be a str, got {name!r} ({type(name).__name__})")
        entry = self.registry.get(component_kind.name, name)
        component = entry.factory(*args, **kwargs)
        if component_kind.base is not None and not isinstance(component, component_kind.base):
            raise PluginRegistrationError(
                f"the factory for {kind} {name!r} from plugin {entry.plugin!r} returned "
                f"{type(component).__module__}.{type(component).__qualname__}; expected an instance of "
                f"{component_kind.base.__module__}.{component_kind.base.__qualname__}"
            )
        return component

    def create_prefix_cache(
        self, name: str, *, device: Any = "cpu", page_size: int = 1, **options: Any
    ) -> BasePrefixCache:
        """Build the prefix cache registered as ``name`` (``"naive"``, ``"radix"``, or a plugin's)."""
        config = PrefixCacheConfig(device=device, page_size=page_size, options=options)
        return self.create("prefix_cache", name, config)

    def create_kv_pool(self, name: str, config: KVPoolConfig) -> BaseKVPool:
        return self.create("kv_pool", name, config)

    def create_attention_backend(self, name: str, config: AttentionConfig) -> BaseAttentionBackend:
        """Build an attention backend; ``"P,D"`` builds a hybrid of prefill backend P and decode backend D."""
        if isinstance(name, str) and "," in name:
            from kvplug.attention.hybrid import HybridAttentionBackend

            prefill_name, _, decode_name = (part.strip() for part in name.partition(","))
            return HybridAttentionBackend(
                self.create("attention", prefill_name, config), self.create("attention", decode_name, config)
            )
        return self.create("attention", name, config)

    def plugins(self) -> list[PluginInfo]:
        """Every registered plugin, built-ins first, with what it provides by kind."""
        provided: dict[str, dict[str, list[str]]] = {}
        for kind in COMPONENT_KINDS:
            for entry in self.registry.entries(kind):
                provided.setdefault(entry.plugin, {}).setdefault(kind, []).append(entry.name)
        infos = []
        for name, plugin in self._pluggy.list_name_plugin():
            distribution, version, builtin = self._origins.get(name, ("unknown", "unknown", False))
            infos.append(PluginInfo(name, distribution, version, _source_file(plugin), builtin, provided.get(name, {})))
        return sorted(infos, key=lambda info: (not info.builtin, info.name))


def _source_file(plugin: Any) -> str | None:
    target = plugin if inspect.ismodule(plugin) or inspect.isclass(plugin) else type(plugin)
    try:
        return inspect.getsourcefile(target) or getattr(target, "__file__", None)
    except TypeError:
        return getattr(target, "__file__", None)


_default_manager: PluginManager | None = None
_default_lock = threading.Lock()


def default_manager() -> PluginManager:
    """The lazily built process-wide manager behind ``kvplug.available`` and friends."""
    global _default_manager
    with _default_lock:
        if _default_manager is None:
            _default_manager = PluginManager()
        return _default_manager


def reset_default_manager(manager: PluginManager | None = None) -> None:
    """Drop (or replace) the default manager, e.g. after installing a plugin at run time."""
    global _default_manager
    with _default_lock:
        _default_manager = manager


