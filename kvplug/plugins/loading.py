"""Loads third-party plugins from the ``kvplug`` entry-point group, one entry point at a time.

Environment variables (read from the mapping given, ``os.environ`` by default):

- ``KVPLUG_LOAD_PLUGINS=a,b``: load only these entry points (an empty value loads none).
- ``KVPLUG_DISABLE_PLUGINS=a,b``: never load these.
- ``KVPLUG_STRICT_PLUGINS=1``: a plugin that fails to load raises instead of warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Mapping

import pluggy

from kvplug.hookspecs import PROJECT_NAME
from kvplug.interface import PluginLoadError

ENTRY_POINT_GROUP = PROJECT_NAME
TRUE_VALUES = {"1", "true", "yes", "on"}


class PluginLoadWarning(UserWarning):
    """A plugin entry point failed to import or validate and was skipped."""


@dataclass(frozen=True)
class PluginSelection:
    """Which entry points to load, from the environment."""

    allow: frozenset[str] | None
    block: frozenset[str]
    strict: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "PluginSelection":
        allow_value = env.get("KVPLUG_LOAD_PLUGINS")
        return cls(
            allow=None if allow_value is None else _split_names(allow_value),
            block=_split_names(env.get("KVPLUG_DISABLE_PLUGINS", "")),
            strict=env.get("KVPLUG_STRICT_PLUGINS", "").strip().lower() in TRUE_VALUES,
        )

    def wants(self, name: str) -> bool:
        return name not in self.block and (self.allow is None or name in self.allow)


@dataclass(frozen=True)
class LoadFailure:
    """An entry point that was skipped, and why."""

    entry_point: str
    distribution: str
    version: str
    error: BaseException

    def describe(self) -> str:
        return (
            f"kvplug plugin entry point {self.entry_point!r} from distribution {self.distribution} "
            f"{self.version} failed to load: {type(self.error).__name__}: {self.error}"
        )


def distribution_of(entry_point: metadata.EntryPoint) -> tuple[str, str]:
    """(distribution name, version) of an entry point, or ("unknown", "unknown")."""
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return "unknown", "unknown"
    return dist.metadata["Name"] or "unknown", dist.version or "unknown"


def kvplug_entry_points() -> list[metadata.EntryPoint]:
    """Entry points of the group, de-duplicated by (name, value) and sorted by name."""
    seen: dict[tuple[str, str], metadata.EntryPoint] = {}
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        seen.setdefault((entry_point.name, entry_point.value), entry_point)
    return sorted(seen.values(), key=lambda ep: ep.name)


def load_entry_points(
    register: Callable[[Any, str, str, str], None], env: Mapping[str, str]
) -> list[LoadFailure]:
    """Import and register each selected entry point.

    ``register(plugin_object, name, distribution, version)`` adds one plugin to the manager and may
    raise (e.g. ``pluggy.PluginValidationError``). Failures become ``PluginLoadWarning`` and are
    returned, or raise when strict: ``PluginLoadError`` for import failures, pluggy's own
    ``PluginValidationError`` for hook implementations that do not match their spec.
    """
    selection = PluginSelection.from_env(env)
    failures: list[LoadFailure] = []
    for entry_point in kvplug_entry_points():
        if not selection.wants(entry_point.name):
            continue
        distribution, version = distribution_of(entry_point)
        try:
            plugin = entry_point.load()
            register(plugin, entry_point.name, distribution, version)
        except Exception as error:  # a broken plugin must not take the others down
            failure = LoadFailure(entry_point.name, distribution, version, error)
            if selection.strict:
                if isinstance(error, pluggy.PluginValidationError):
                    raise pluggy.PluginValidationError(error.plugin, failure.describe()) from error
                raise PluginLoadError(failure.describe() + " (KVPLUG_STRICT_PLUGINS is set)") from error
            warnings.warn(failure.describe(), PluginLoadWarning, stacklevel=3)
            failures.append(failure)
    return failures


def _split_names(value: str) -> frozenset[str]:
    return frozenset(name.strip() for name in value.split(",") if name.strip())
