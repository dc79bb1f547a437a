"""Collects what each plugin registers, kind by kind, remembering which plugin provides each name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pluggy

from kvplug.interface import DuplicateComponentError, PluginRegistrationError, UnknownComponentError
from kvplug.plugins.kinds import ComponentKind


@dataclass(frozen=True)
class ComponentEntry:
    """One registered component: its kind, name, factory and the plugin that registered it."""

    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str


class ComponentRegistry:
    """Name → entry tables for every kind, built by calling each plugin's hooks one at a time."""

    def __init__(self, entries: dict[str, dict[str, ComponentEntry]]) -> None:
        self._entries = entries

    @classmethod
    def collect(cls, manager: pluggy.PluginManager, kinds: Iterable[ComponentKind]) -> "ComponentRegistry":
        entries: dict[str, dict[str, ComponentEntry]] = {}
        for kind in kinds:
            table: dict[str, ComponentEntry] = {}
            for hookimpl in getattr(manager.hook, kind.hook).get_hookimpls():
                _call_hook(hookimpl, kind, table)
            entries[kind.name] = table
        return cls(entries)

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def entries(self, kind: str) -> list[ComponentEntry]:
        return [self._entries[kind][name] for name in self.names(kind)]

    def get(self, kind: str, name: str) -> ComponentEntry:
        table = self._entries[kind]
        if name in table:
            return table[name]
        available = ", ".join(f"{entry.name!r} (from {entry.plugin})" for entry in self.entries(kind))
        raise UnknownComponentError(
            f"unknown {kind} {name!r}; available: {available or 'none'}. "
            "Install the plugin that provides it, or check KVPLUG_LOAD_PLUGINS / KVPLUG_DISABLE_PLUGINS."
        )


def _call_hook(hookimpl: pluggy.HookImpl, kind: ComponentKind, table: dict[str, ComponentEntry]) -> None:
    plugin = hookimpl.plugin_name

    def register(name: Any, factory: Any) -> None:
        if not isinstance(name, str):
            raise PluginRegistrationError(
                f"plugin {plugin!r} registered a {kind.name} with a non-string name {name!r} "
                f"({type(name).__name__}); expected a non-empty str"
            )
        if not name.strip() or name != name.strip() or "," in name:
            raise PluginRegistrationError(
                f"plugin {plugin!r} registered a {kind.name} named {name!r}; expected a non-empty name "
                "without surrounding spaces or commas"
            )
        if not callable(factory):
            raise PluginRegistrationError(
                f"plugin {plugin!r} registered {kind.name} {name!r} with a factory that is not callable: {factory!r}"
            )
        if name in table:
            raise DuplicateComponentError(
                f"{kind.name} {name!r} is registered twice: by plugin {table[name].plugin!r} and by plugin "
                f"{plugin!r}; disable one of them with KVPLUG_DISABLE_PLUGINS"
            )
        table[name] = ComponentEntry(kind.name, name, factory, plugin)

    arguments = {"register": register}
    hookimpl.function(*[arguments[argname] for argname in hookimpl.argnames])
