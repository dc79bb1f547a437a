"""The core never imports a host (docs/design.md, section 2): an AST scan of every module under kvplug/.

Host packages are the adapters' import packages (every ``adapters/<host>/kvplug_*`` package) and
the host engines themselves. A host is reached only through the plugin manager
(``kvplug_register_hosts``), so an import of one here is a layering bug, wherever it hides
(function bodies, ``TYPE_CHECKING`` blocks, ``importlib.import_module("...")`` with a literal).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "kvplug"
HOST_ENGINES = {"transformers", "sglang", "vllm"}
# the one justified exception: SGLang's RadixCache driven as a benchmark anchor next to kvplug's
# radix cache (a comparison, not a host integration; importable only where SGLang is)
ALLOWED = {("kvplug/bench/sglang_anchor.py", "sglang")}


def host_packages() -> set[str]:
    adapters = {path.parent.name for path in (ROOT / "adapters").glob("*/kvplug_*/__init__.py")}
    assert {"kvplug_transformers", "kvplug_sglang"} <= adapters, adapters
    return adapters | HOST_ENGINES


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, top-level package)`` of every import in ``tree``, including literal ``import_module`` calls."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value.split(".")[0]))
    return found


def test_no_module_under_kvplug_imports_a_host_package():
    hosts = host_packages()
    offenders = []
    modules = sorted(CORE.rglob("*.py"))
    assert len(modules) > 50  # the scan sees the package
    for path in modules:
        relative = path.relative_to(ROOT).as_posix()
        for line, package in imported_modules(ast.parse(path.read_text(encoding="utf-8"), filename=relative)):
            if package in hosts and (relative, package) not in ALLOWED:
                offenders.append(f"{relative}:{line} imports {package}")
    assert not offenders, "the core imports a host package:\n" + "\n".join(offenders)


def test_the_scan_finds_imports_wherever_they_hide():
    source = '''
import os
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from kvplug_transformers.host import TransformersHost
def run():
    import transformers.generation as generation
    importlib.import_module("kvplug_sglang.plugin")
    return __import__("vllm")
from . import sibling
'''
    found = {package for _, package in imported_modules(ast.parse(source))}
    assert found == {"os", "typing", "kvplug_transformers", "transformers", "kvplug_sglang", "vllm"}
