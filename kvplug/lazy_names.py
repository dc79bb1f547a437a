"""Module attributes imported on first access: what lets ``import kvplug`` (and a plugin doing
``from kvplug import hookimpl``, or ``kvplug --version``) skip torch's second-long import.

A package lists its public names and the modules defining them, and takes its module-level
``__getattr__`` and ``__dir__`` from ``lazy_attributes``. Once imported, a name is stored in the
package's namespace, so later accesses do not reach ``__getattr__`` again.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any, Callable, Collection, Mapping


def lazy_attributes(
    package: str, names: Mapping[str, str], submodules: Collection[str] | bool = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``.

    Args:
        package: the package's ``__name__``.
        names: public name -> the module defining it.
        submodules: sub-modules reachable as attributes (``True``: any that exists).
    """

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
        elif (submodules is True and not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}")) or (
            submodules is not True and name in submodules
        ):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)  # later accesses skip __getattr__
        return value

    def __dir__() -> list[str]:
        module = sys.modules[package]
        return sorted(set(vars(module)) | set(getattr(module, "__all__", ())))

    return __getattr__, __dir__
