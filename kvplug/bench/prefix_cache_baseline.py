"""Another version's ``radix`` cache beside this one, in the same process (``--baseline DIR``).

Why: the bars compare versions side by side in one run, and two versions of ``kvplug.prefix_cache``
cannot both import under their own name. So the baseline's modules (``DIR`` is a copy of another
checkout's ``kvplug/prefix_cache``, e.g. ``git archive ef62ca7 kvplug/prefix_cache | tar -x -C /tmp``)
are loaded under a private package name with their ``kvplug.prefix_cache.`` imports pointed at
it; everything else they import (the interface, the host pool) is this version's.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import pathlib
import sys

import torch

from kvplug.bench.prefix_cache_drivers import KvplugDriver
from kvplug.interface import PrefixCacheConfig

_PACKAGES = itertools.count()


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """Loads a baseline module with ``kvplug.prefix_cache.`` renamed; never reads or writes bytecode."""

    def __init__(self, fullname: str, path: str, package: str) -> None:
        super().__init__(fullname, path)
        self._package = package

    def get_code(self, fullname: str):
        text = self.get_data(self.path).decode("utf-8").replace("kvplug.prefix_cache.", self._package + ".")
        return compile(text, self.path, "exec", dont_inherit=True)


class _BaselineFinder(importlib.abc.MetaPathFinder):
    def __init__(self, package: str, directory: pathlib.Path) -> None:
        self._package = package
        self._directory = directory

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self._package:
            file, search = self._directory / "__init__.py", [str(self._directory)]
        elif fullname.startswith(self._package + ".") and fullname.count(".") == self._package.count(".") + 1:
            file, search = self._directory / (fullname.rsplit(".", 1)[1] + ".py"), None
        else:
            return None
        if not file.is_file():
            return None
        loader = _RewritingLoader(fullname, str(file), self._package)
        return importlib.util.spec_from_file_location(fullname, file, loader=loader, submodule_search_locations=search)


def load_baseline_radix(directory: str | pathlib.Path) -> type:
    """The ``RadixPrefixCache`` class of the ``prefix_cache`` package copy in ``directory``."""
    directory = pathlib.Path(directory).resolve()
    if not (directory / "radix.py").is_file():
        raise FileNotFoundError(f"--baseline {directory}: expected a copy of kvplug/prefix_cache (no radix.py there)")
    package = f"_kvplug_baseline_prefix_cache_{next(_PACKAGES)}"
    sys.meta_path.insert(0, _BaselineFinder(package, directory))
    return importlib.import_module(package + ".radix").RadixPrefixCache


class BaselineRadixDriver(KvplugDriver):
    """The baseline's ``radix`` on the CPU, driven exactly as ``KvplugDriver`` drives this one's."""

    def __init__(self, cache_class: type, page_size: int, *, tensor_inputs: bool = False) -> None:
        self.name = "baseline-radix"
        self.device = torch.device("cpu")
        self.cache = cache_class(PrefixCacheConfig(device="cpu", page_size=page_size))
        self._use_host_arrays(tensor_inputs)
