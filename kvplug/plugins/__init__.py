"""Plugin machinery: component kinds, the registry, entry-point loading and the manager."""

from kvplug.plugins.kinds import COMPONENT_KINDS, ComponentKind
from kvplug.plugins.loading import ENTRY_POINT_GROUP, LoadFailure, PluginLoadWarning
from kvplug.plugins.manager import PluginInfo, PluginManager, default_manager, reset_default_manager
from kvplug.plugins.registry import ComponentEntry, ComponentRegistry

__all__ = [
    "COMPONENT_KINDS",
    "ENTRY_POINT_GROUP",
    "ComponentEntry",
    "ComponentKind",
    "ComponentRegistry",
    "LoadFailure",
    "PluginInfo",
    "PluginLoadWarning",
    "PluginManager",
    "default_manager",
    "reset_default_manager",
]
