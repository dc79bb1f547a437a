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
from typing import TYPE_CHECKING, Any, Mapping

import pluggy

from kvplug import hookspecs
from kvplug._version import __version__
from kvplug.plugins.kinds import COMPONENT_KINDS, get_kind
from kvplug.plugins.loading import FilteredEntryPoint, LoadFailure, load_entry_points
from kvplug.plugins.registry import ComponentEntry, ComponentRegistry, collect_plugin

if TYPE_CHECKING:  # the interface's tensor types are imported only when a component is built
    from kvplug.interface import AttentionConfig, BaseAttentionBackend, BaseKVPool, BasePrefixCache, KVPoolConfig

BUILTIN_PLUGINS = (
    "kvplug.builtin.prefix_caches",
    "kvplug.builtin.kv_pools",
    "kvplug.builtin.attention",
    "kvplug.builtin.kv_stores",
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

    A plugin's registration hooks are called once, when it is registered; a plugin whose hooks
    fail, or that registers a name another plugin already provides, is refused there and leaves
    the manager as it was. Built-ins are registered first, so they win every collision.

    Args:
        builtins: register kvplug's built-in components (they are plugins too).
        entry_points: load the ``kvplug`` entry-point group now.
        env: environment for ``KVPLUG_*`` variables; ``os.environ`` by default.

    Attributes:
        load_failures: entry points that failed to load and were skipped, with the reason.
        filtered_out: installed entry points that ``KVPLUG_LOAD_PLUGINS`` /
            ``KVPLUG_DISABLE_PLUGINS`` kept from loading.
    """

    def __init__(self, *, builtins: bool = True, entry_points: bool = True, env: Mapping[str, str] | None = None):
        self._pluggy = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pluggy.add_hookspecs(hookspecs)
        self._origins: dict[str, tuple[str, str, bool]] = {}
        # plugin name -> its entries by kind, in registration order (earlier plugins win collisions)
        self._provided: dict[str, dict[str, list[ComponentEntry]]] = {}
        self._registry = ComponentRegistry.merge(COMPONENT_KINDS.values(), [])
        self.load_failures: list[LoadFailure] = []
        self.filtered_out: list[FilteredEntryPoint] = []
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

        Calls the plugin's registration hooks now. Raises, leaving the manager unchanged:

        - ``pluggy.PluginValidationError`` for a hook implementation whose name starts with
          ``kvplug_`` but matches no hook, or that takes an argument its hook does not offer;
        - ``kvplug.DuplicateComponentError`` naming both plugins when it registers a name another
          registered plugin provides for the same kind;
        - ``kvplug.PluginRegistrationError`` for a bad ``register`` call, or a hook that raises or
          calls ``sys.exit``.
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
            from kvplug.interface import PluginRegistrationError

            raise PluginRegistrationError(f"plugin {plugin_name!r} is blocked or already registered")
        try:
            entries = collect_plugin(self._pluggy, COMPONENT_KINDS.values(), registered)
            registry = ComponentRegistry.merge(COMPONENT_KINDS.values(), [*self._provided.values(), entries])
        except BaseException:
            self._pluggy.unregister(name=registered)
            raise
        if builtin:
            distribution, version = "kvplug", __version__
        self._origins[registered] = (distribution or "unknown", version or "unknown", builtin)
        self._provided[registered] = entries
        self._registry = registry
        return registered

    def unregister(self, name: str) -> None:
        self._pluggy.unregister(name=name)
        self._origins.pop(name, None)
        self._provided.pop(name, None)
        self._registry = ComponentRegistry.merge(COMPONENT_KINDS.values(), self._provided.values())

    def load_entry_points(self, env: Mapping[str, str] | None = None) -> list[LoadFailure]:
        """Load the ``kvplug`` entry-point group (see ``kvplug.plugins.loading``); the failures."""

        def register(plugin: Any, name: str, distribution: str, version: str) -> None:
            if self._pluggy.has_plugin(name):
                return
            self.register(plugin, name, distribution=distribution, version=version)

        outcome = load_entry_points(register, os.environ if env is None else env)
        self.load_failures.extend(outcome.failures)
        self.filtered_out.extend(outcome.filtered_out)
        return outcome.failures

    def why_not_loaded(self, entry_point: str) -> str:
        """Why the entry point ``entry_point`` provides nothing here, in words for an error message:
        filtered out by the environment, failed to load (and why), or not installed."""
        for failure in self.load_failures:
            if failure.entry_point == entry_point:
                return f"its plugin failed to load: {failure.reason}"
        for filtered in self.filtered_out:
            if filtered.entry_point == entry_point:
                return (
                    f"it is installed ({filtered.distribution} {filtered.version}) but not loaded: {filtered.why}"
                )
        if self._pluggy.has_plugin(entry_point):
            return "its plugin is loaded but registers nothing under that name"
        return "it is not installed"

    @property
    def registry(self) -> ComponentRegistry:
        return self._registry

    def available(self, kind: str) -> list[str]:
        """Registered names for ``kind`` (``prefix_cache``, ``kv_pool``, ``attention``, ``host``, ``kv_store``)."""
        return self.registry.names(get_kind(kind).name)

    def providers(self, kind: str) -> dict[str, str]:
        """Name → providing plugin, for ``kind``."""
        return {entry.name: entry.plugin for entry in self.registry.entries(get_kind(kind).name)}

    def create(self, kind: str, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the factory registered as ``name`` for ``kind`` and check what it returns."""
        component_kind = get_kind(kind)
        entry = self.registry.get(component_kind.name, _checked_name(kind, name))
        component = entry.factory(*args, **kwargs)
        if component_kind.base is not None and not isinstance(component, component_kind.base):
            from kvplug.interface import PluginRegistrationError

            raise PluginRegistrationError(
                f"the factory for {kind} {name!r} from plugin {entry.plugin!r} returned "
                f"{type(component).__module__}.{type(component).__qualname__}; expected an instance of "
                f"{component_kind.base.__module__}.{component_kind.base.__qualname__}"
            )
        return component

    def create_prefix_cache(
        self, name: str, *, device: Any = "cpu", page_size: int = 1, **options: Any
    ) -> BasePrefixCache:
        """Build the prefix cache registered as ``name`` (``"naive"``, ``"radix"``, or a plugin's).

        Naming CUDA on a machine without it is an ``InvalidArgumentError``, as in ``create_backend``.
        """
        from kvplug.devices import resolve_device
        from kvplug.interface import PrefixCacheConfig

        device = resolve_device(device, require_available=True)
        config = PrefixCacheConfig(device=device, page_size=page_size, options=options)
        return self.create("prefix_cache", name, config)

    def create_kv_pool(self, name: str, config: KVPoolConfig) -> BaseKVPool:
        """Build the KV pool registered as ``name`` (``"mha"``) from a ``kvplug.KVPoolConfig``."""
        from kvplug.interface import KVPoolConfig

        _check_config("kv_pool", config, KVPoolConfig)
        return self.create("kv_pool", name, config)

    def create_attention_backend(self, name: str, config: AttentionConfig) -> BaseAttentionBackend:
        """Build an attention backend; ``"P,D"`` builds a hybrid of prefill backend P and decode backend D."""
        from kvplug.interface import AttentionConfig

        _check_config("attention", config, AttentionConfig)
        if isinstance(name, str) and "," in name:
            from kvplug.attention.hybrid import HybridAttentionBackend

            prefill_name, _, decode_name = (part.strip() for part in name.partition(","))
            return HybridAttentionBackend(
                self.create("attention", prefill_name, config), self.create("attention", decode_name, config)
            )
        return self.create("attention", name, config)

    def create_kv_store(self, url: str, **options: Any) -> Any:
        """Build the shared KV store that ``url``'s scheme names (``redis://...`` → ``redis``);
        ``options`` reach the factory as ``config.options``. Nothing is connected yet."""
        from kvplug.interface import KVStoreConfig

        config = KVStoreConfig(url=url, options=options)
        return self.create("kv_store", config.scheme, config)

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


def _checked_name(kind: str, name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{kind} name must be a str, got {name!r} ({type(name).__name__})")
    return name


def _check_config(kind: str, config: Any, expected: type) -> None:
    if not isinstance(config, expected):
        from kvplug.interface import InvalidArgumentError

        raise InvalidArgumentError(
            f"a {kind} is built from a kvplug.{expected.__name__}, got {config!r} ({type(config).__name__})"
        )


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


