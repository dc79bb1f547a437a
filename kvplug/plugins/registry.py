"""Collects what each plugin registers, kind by kind, remembering which plugin provides each name.

A plugin's hooks are called once, when it is registered (``collect_plugin``); the registry is then
merged from every plugin's entries in registration order (``ComponentRegistry.merge``), which is
where a name registered by two plugins is caught and both plugins are named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import pluggy

from kvplug.plugins.kinds import ComponentKind

# kind name -> the entries one plugin registered for it, in the order it registered them
PluginEntries = Mapping[str, list["ComponentEntry"]]


@dataclass(frozen=True)
class ComponentEntry:
    """One registered component: its kind, name, factory and the plugin that registered it."""

    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str


class ComponentRegistry:
    """Name → entry tables for every kind."""

    def __init__(self, entries: dict[str, dict[str, ComponentEntry]]) -> None:
        self._entries = entries

    @classmethod
    def merge(cls, kinds: Iterable[ComponentKind], plugins: Iterable[PluginEntries]) -> "ComponentRegistry":
        """The registry of ``plugins`` (each one plugin's entries), earlier plugins first.

        Raises ``DuplicateComponentError`` naming both plugins when two register the same name for
        the same kind.
        """
        entries: dict[str, dict[str, ComponentEntry]] = {kind.name: {} for kind in kinds}
        for plugin_entries in plugins:
            for kind, kind_entries in plugin_entries.items():
                table = entries[kind]
                for entry in kind_entries:
                    if entry.name in table:
                        from kvplug.interface import DuplicateComponentError

                        raise DuplicateComponentError(
                            f"{kind} {entry.name!r} is registered twice: by plugin {table[entry.name].plugin!r} "
                            f"and by plugin {entry.plugin!r}; disable one of them with KVPLUG_DISABLE_PLUGINS"
                        )
                    table[entry.name] = entry
        return cls(entries)

    @classmethod
    def collect(cls, manager: pluggy.PluginManager, kinds: Iterable[ComponentKind]) -> "ComponentRegistry":
        """Call the hooks of every plugin ``manager`` holds, in registration order, and merge them."""
        kinds = list(kinds)
        plugin_names = [name for name, _ in manager.list_name_plugin()]
        return cls.merge(kinds, [collect_plugin(manager, kinds, name) for name in plugin_names])

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def entries(self, kind: str) -> list[ComponentEntry]:
        return [self._entries[kind][name] for name in self.names(kind)]

    def get(self, kind: str, name: str) -> ComponentEntry:
        table = self._entries[kind]
        if name in table:
            return table[name]
        from kvplug.interface import UnknownComponentError

        available = ", ".join(f"{entry.name!r} (from {entry.plugin})" for entry in self.entries(kind))
        raise UnknownComponentError(
            f"unknown {kind} {name!r}; available: {available or 'none'}. "
            "Install the plugin that provides it, or check KVPLUG_LOAD_PLUGINS / KVPLUG_DISABLE_PLUGINS."
        )


def collect_plugin(
    manager: pluggy.PluginManager, kinds: Iterable[ComponentKind], plugin: str
) -> dict[str, list[ComponentEntry]]:
    """Call the registration hooks of the one plugin named ``plugin``; its entries by kind.

    Raises ``PluginRegistrationError`` naming the plugin for a bad ``register`` call, and for a
    hook that raises or calls ``sys.exit`` (chained to the original exception).
    """
    entries: dict[str, list[ComponentEntry]] = {}
    for kind in kinds:
        for hookimpl in getattr(manager.hook, kind.hook).get_hookimpls():
            if hookimpl.plugin_name == plugin:
                entries.setdefault(kind.name, []).extend(_call_hook(hookimpl, kind))
    return entries


def _call_hook(hookimpl: pluggy.HookImpl, kind: ComponentKind) -> list[ComponentEntry]:
    # kvplug.interface (and torch with it) is imported only on error paths: loading plugins needs neither
    plugin = hookimpl.plugin_name
    registered: dict[str, ComponentEntry] = {}

    def register(name: Any, factory: Any) -> None:
        if not isinstance(name, str):
            raise _registration_error(
                f"plugin {plugin!r} registered a {kind.name} with a non-string name {name!r} "
                f"({type(name).__name__}); expected a non-empty str"
            )
        if not name.strip() or name != name.strip() or "," in name:
            raise _registration_error(
                f"plugin {plugin!r} registered a {kind.name} named {name!r}; expected a non-empty name "
                "without surrounding spaces or commas"
            )
        if not callable(factory):
            raise _registration_error(
                f"plugin {plugin!r} registered {kind.name} {name!r} with a factory that is not callable: {factory!r}"
            )
        if name in registered:
            raise _registration_error(f"plugin {plugin!r} registered {kind.name} {name!r} twice")
        registered[name] = ComponentEntry(kind.name, name, factory, plugin)

    arguments = {"register": register}
    try:
        hookimpl.function(*[arguments[argname] for argname in hookimpl.argnames])
    except (Exception, SystemExit) as error:  # a plugin's hook must not take the process or the others down
        from kvplug.interface import KVPlugError

        if isinstance(error, KVPlugError):
            raise
        if isinstance(error, SystemExit):
            what = f"called sys.exit({error.code!r})"
        else:
            what = f"raised {type(error).__name__}: {error}"
        raise _registration_error(f"plugin {plugin!r} {what} in its hook {kind.hook}") from error
    return list(registered.values())


def _registration_error(message: str) -> Exception:
    from kvplug.interface import PluginRegistrationError

    return PluginRegistrationError(message)
