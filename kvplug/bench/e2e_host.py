"""What ``kvplug bench e2e`` asks of a host, and how it finds one: by name, through the plugin manager.

The core never imports a host (docs/design.md, section 2). A host adapter that can run the
end-to-end benchmark gives its host object (``kvplug_register_hosts``) an ``e2e_bench()`` method
returning an ``E2EHost``; the benchmark looks the host up by name (``--host``, default
``transformers``) and drives it through this interface only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, NamedTuple

from kvplug.interface.errors import PluginLoadError

if TYPE_CHECKING:
    import torch

    from kvplug.bench.e2e_model import ModelShapeSpec
    from kvplug.bench.e2e_runner import RunConfig
    from kvplug.bench.e2e_workloads import Workload
    from kvplug.memory.model_shape import ModelShape
    from kvplug.plugins.manager import PluginManager

DEFAULT_HOST = "transformers"
INSTALL_HINTS = {"transformers": "pip install ./adapters/transformers (distribution kvplug-transformers)"}


class BenchModel(NamedTuple):
    """A model a host built for the benchmark.

    Attributes:
        model: the host's model object (handed back to ``E2EHost.run_variant`` unchanged).
        vocab_size: token ids of the workloads are drawn below it.
        shape: the KV geometry (bytes per token for the host-tier sizes, the copy benchmark).
    """

    model: Any
    vocab_size: int
    shape: "ModelShape"


class E2EHost(ABC):
    """A host that serves the benchmark's workloads with one KV-cache variant at a time."""

    @abstractmethod
    def build_model(self, shape_name: str, spec: "ModelShapeSpec", seed: int, device: "torch.device",
                    dtype: "torch.dtype") -> BenchModel:
        """A random-weight model of ``spec`` (drawn from ``seed``), in eval mode, on ``device`` in ``dtype``."""

    @abstractmethod
    def run_variant(self, model: BenchModel, variant: str, config: "RunConfig", workload: "Workload") -> dict[str, Any]:
        """Every round of ``workload`` with ``variant`` (``e2e_runner.parse_variant``); returns
        ``e2e_runner.summarize``'s figures plus the cache counters (``None`` where the variant has
        no kvplug cache)."""

    @abstractmethod
    def versions(self) -> dict[str, str]:
        """Versions of the host's packages, for the result's ``environment``."""


def find_e2e_host(name: str = DEFAULT_HOST, manager: "PluginManager | None" = None) -> E2EHost:
    """The ``E2EHost`` of the host plugin named ``name``, or a ``PluginLoadError`` naming the
    adapter to install (or why it did not load)."""
    from kvplug.plugins.manager import PluginManager

    manager = PluginManager() if manager is None else manager
    if name not in manager.available("host"):
        hint = INSTALL_HINTS.get(name, f"install the kvplug plugin that registers the host {name!r}")
        known = ", ".join(repr(host) for host in manager.available("host")) or "none"
        raise PluginLoadError(
            f"kvplug bench e2e needs the {name!r} host adapter: {manager.why_not_loaded(name)} "
            f"(hosts available: {known}); to install it: {hint}"
        )
    host = manager.create("host", name)
    factory = getattr(host, "e2e_bench", None)
    if not callable(factory):
        raise PluginLoadError(f"the {name!r} host ({type(host).__qualname__}) has no e2e_bench(): "
                              "it cannot run kvplug bench e2e")
    runner = factory()
    if not isinstance(runner, E2EHost):
        raise PluginLoadError(f"the {name!r} host's e2e_bench() returned {type(runner).__qualname__}, "
                              "expected a kvplug.bench.e2e_host.E2EHost")
    return runner
