"""Loads third-party plugins from the ``kvplug`` entry-point group, one entry point at a time.

Environment variables (read from the mapping given, ``os.environ`` by default):

- ``KVPLUG_LOAD_PLUGINS=a,b``: load only these entry points (an empty value loads none).
- ``KVPLUG_DISABLE_PLUGINS=a,b``: never load these.
- ``KVPLUG_STRICT_PLUGINS=1``: a plugin that fails to load raises instead of warning.

A plugin fails to load when importing it raises (``SystemExit`` included), when one of its hooks
raises or registers badly, or when it registers a name another plugin (a built-in, or one loaded
before it) already provides. Without strict mode it is skipped, warned about and reported in
``PluginManager.load_failures``; everything loaded before it stays as it was.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Mapping, NamedTuple

import pluggy

from kvplug.hookspecs import PROJECT_NAME

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
        return self.why_not(name) is None

    def why_not(self, name: str) -> str | None:
        """Why entry point ``name`` is not loaded (the variable that filters it out), or ``None``."""
        if name in self.block:
            return "KVPLUG_DISABLE_PLUGINS lists it"
        if self.allow is not None and name not in self.allow:
            listed = ",".join(sorted(self.allow))
            return f"KVPLUG_LOAD_PLUGINS={listed!r} does not list it"
        return None


@dataclass(frozen=True)
class LoadFailure:
    """An entry point that was skipped, and why."""

    entry_point: str
    distribution: str
    version: str
    error: BaseException

    @property
    def reason(self) -> str:
        """The error in one line: ``"RuntimeError: ..."``, or ``"called sys.exit(3)"``."""
        if isinstance(self.error, SystemExit):
            return f"called sys.exit({self.error.code!r}) on import"
        return f"{type(self.error).__name__}: {self.error}"

    def describe(self) -> str:
        return (
            f"kvplug plugin entry point {self.entry_point!r} from distribution {self.distribution} "
            f"{self.version} failed to load: {self.reason}"
        )


@dataclass(frozen=True)
class FilteredEntryPoint:
    """An installed entry point that the environment told kvplug not to load."""

    entry_point: str
    distribution: str
    version: str
    why: str


class LoadOutcome(NamedTuple):
    """What ``load_entry_points`` did besides loading: the failures and the filtered-out entry points."""

    failures: list[LoadFailure]
    filtered_out: list[FilteredEntryPoint]


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


def load_entry_points(register: Callable[[Any, str, str, str], None], env: Mapping[str, str]) -> LoadOutcome:
    """Import and register each selected entry point.

    ``register(plugin_object, name, distribution, version)`` adds one plugin to the manager, or
    raises and leaves the manager as it was (``pluggy.PluginValidationError``, a kvplug
    registration error for a raising hook or a name collision). Failures become
    ``PluginLoadWarning`` and are returned, or raise when strict: pluggy's own
    ``PluginValidationError`` for hook implementations that do not match their spec,
    ``PluginLoadError`` for everything else.
    """
    selection = PluginSelection.from_env(env)
    outcome = LoadOutcome([], [])
    for entry_point in kvplug_entry_points():
        distribution, version = distribution_of(entry_point)
        why_not = selection.why_not(entry_point.name)
        if why_not is not None:
            outcome.filtered_out.append(FilteredEntryPoint(entry_point.name, distribution, version, why_not))
            continue
        try:
            plugin = entry_point.load()
            register(plugin, entry_point.name, distribution, version)
        except (Exception, SystemExit) as error:  # a broken plugin must not take the others (or the process) down
            failure = LoadFailure(entry_point.name, distribution, version, error)
            if selection.strict:
                if isinstance(error, pluggy.PluginValidationError):
                    raise pluggy.PluginValidationError(error.plugin, failure.describe()) from error
                from kvplug.interface import PluginLoadError

                raise PluginLoadError(failure.describe() + " (KVPLUG_STRICT_PLUGINS is set)") from error
            warnings.warn(failure.describe() + " (skipped; the other plugins load)", PluginLoadWarning, stacklevel=3)
            outcome.failures.append(failure)
    return outcome


def _split_names(value: str) -> frozenset[str]:
    return frozenset(name.strip() for name in value.split(",") if name.strip())
