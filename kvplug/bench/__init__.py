"""Benchmark suites, run as ``kvplug bench SUITE [--out FILE.json] [--quick] [suite options]``.

A suite is a module of this package that exposes:

- ``SUITE``: the sub-command name, e.g. ``"prefix-cache"``;
- ``add_arguments(parser)``: its own options (the CLI adds ``--out`` and ``--quick`` to every suite,
  so a suite must not define those two);
- ``run(args) -> dict``: runs, prints a human-readable table, returns JSON-serialisable results;
- optionally ``REQUIRES_CUDA = True``: without a CUDA device the CLI reports the suite as skipped
  (exit status 0) instead of running it.

Suites are discovered: adding a module with ``SUITE`` adds a sub-command, nothing else to edit.
Modules without ``SUITE`` are helpers. Import GPU libraries inside ``run``, never at module level:
every ``kvplug`` command imports the suite modules to build its parser.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import NamedTuple


class SuiteImportFailure(NamedTuple):
    """A module of this package that failed to import (reported when its suite is asked for)."""

    module: str
    error: BaseException


def discover_suites() -> tuple[dict[str, ModuleType], list[SuiteImportFailure]]:
    """Every suite module by ``SUITE`` name, and the modules that failed to import."""
    suites: dict[str, ModuleType] = {}
    failures: list[SuiteImportFailure] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if info.name.startswith("_"):
            continue
        name = f"{__name__}.{info.name}"
        try:
            module = importlib.import_module(name)
        except Exception as error:  # one broken suite must not take the whole CLI down
            failures.append(SuiteImportFailure(name, error))
            continue
        suite = getattr(module, "SUITE", None)
        if isinstance(suite, str) and callable(getattr(module, "run", None)):
            suites[suite] = module
    return suites, failures
