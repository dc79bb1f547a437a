"""Every ``pip install`` hint in the code and the documents names something that exists.

kvplug and its adapters are not on a package index: a hint for them must be a path of this
repository (``pip install -e ".[triton]"``, ``pip install ./adapters/transformers``) whose extras
its ``pyproject.toml`` defines. Any other name must be a requirement one of the repository's
``pyproject.toml`` files declares (torch, triton, sglang, hypothesis, ...), so a typo or an
invented package fails here too.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
SCANNED = ["kvplug", "adapters", "examples", "docs", "README.md"]
SUFFIXES = {".py", ".md", ".toml", ".txt", ".sh", ".cfg"}
HINT = re.compile(r"pip install\b((?:(?!pip install)[^`\n])*)")
# where a hint's arguments end: a comment, the next shell command, a parenthesis
END = re.compile(r"#|&&|;|\(|\)")
OPTIONS_WITH_VALUE = {"--target", "-t", "-c", "--constraint", "-r", "--requirement", "--index-url", "-i"}
# core files the lead engineer edits: their hints are known to point nowhere and are reported to him
CORE_PENDING = {
    "kvplug/attention/common.py", "kvplug/attention/flashinfer_backend.py", "kvplug/attention/fa3_backend.py",
    "kvplug/attention/triton_backend.py", "kvplug/memory/mha_pool.py",
}


def pyprojects() -> dict[Path, dict]:
    found = {}
    for path in REPO.rglob("pyproject.toml"):
        if not any(part.startswith(".") for part in path.relative_to(REPO).parts):
            found[path.parent] = tomllib.loads(path.read_text())["project"]
    return found


PROJECTS = pyprojects()
OWN_NAMES = {canonicalize_name(project["name"]) for project in PROJECTS.values()}
DECLARED = {
    canonicalize_name(Requirement(spec).name)
    for project in PROJECTS.values()
    for spec in [*project.get("dependencies", []),
                 *(s for extra in project.get("optional-dependencies", {}).values() for s in extra)]
} - OWN_NAMES
# tools kvplug works beside, installed in an environment of their own (docs/fleet.md), never a dependency
DECLARED |= {canonicalize_name("ai-dynamo-runtime")}


def hint_arguments(rest: str) -> list[str]:
    """The package arguments of one ``pip install`` hint: options (and their values) dropped."""
    end = END.search(rest)
    text = rest[: end.start()] if end else rest
    try:
        words = shlex.split(text)
    except ValueError:  # the closing quote of the string the hint sits in
        words = re.sub(r"[\"']", " ", text).split()
    arguments, skip_next = [], False
    for word in (w.strip("\"'`,:") for w in words):
        if skip_next:
            skip_next = False
        elif word.startswith("-"):
            skip_next = word in OPTIONS_WITH_VALUE
        elif word and word != "\\":  # a line continuation
            arguments.append(word)
    return arguments


def problem(argument: str) -> str | None:
    """Why ``argument`` (one package argument of a hint) points nowhere, or None."""
    if argument.startswith("$") or "{" in argument.split("[")[0]:
        return None  # a shell variable or a formatted path: not a name
    if argument.startswith((".", "/")):
        path_text, _, extras_text = argument.partition("[")
        folder = (REPO / path_text).resolve()
        if folder not in PROJECTS:
            return f"{path_text} is no folder of this repository with a pyproject.toml"
        defined = set(PROJECTS[folder].get("optional-dependencies", {}))
        extras = {e.strip() for e in extras_text.rstrip("]").split(",") if e.strip() and "{" not in e}  # {extra}: a template
        if extras - defined:
            return f"extras {sorted(extras - defined)} are not defined in {path_text}/pyproject.toml ({sorted(defined)})"
        return None
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", argument)
    if match is None:
        return f"{argument!r} is not a package name"
    name = canonicalize_name(match.group())
    if name in OWN_NAMES:
        return f"{match.group()} is this repository's own package and on no index: name its path (pip install -e \".[extra]\")"
    if name not in DECLARED:
        return f"{match.group()} is not a requirement any pyproject.toml here declares"
    return None


def scanned_files() -> list[str]:
    files = []
    for entry in SCANNED:
        root = REPO / entry
        paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.suffix in SUFFIXES]
        files += [str(p.relative_to(REPO)) for p in paths if "__pycache__" not in p.parts]
    return sorted(files)


def hints_pointing_nowhere(relative: str) -> list[str]:
    bad = []
    for number, line in enumerate((REPO / relative).read_text(errors="replace").splitlines(), 1):
        for hint in HINT.finditer(line):
            for argument in hint_arguments(hint.group(1)):
                reason = problem(argument)
                if reason:
                    bad.append(f"{relative}:{number}: `pip install {argument}`: {reason}")
    return bad


@pytest.mark.parametrize("text, expected", [
    ('pip install -e ".[triton]"', [".[triton]"]), ("pip install kvplug[triton]`", ["kvplug[triton]"]),
    ("pip install ./adapters/transformers (or: pip install kvplug-transformers)", ["./adapters/transformers"]),
    ("pip install torch==2.13.0 \\", ["torch==2.13.0"]),
    ("pip install -q --target /tmp/x -e . -e './adapters/transformers[serve]' && ruff", [".", "./adapters/transformers[serve]"]),
    ("\"kvplug serve needs fastapi: pip install './adapters/transformers[serve]'\"", ["./adapters/transformers[serve]"]),
])
def test_hint_arguments_parse_as_a_shell_would(text, expected):
    assert len(HINT.findall("a `pip install x` b pip install y")) == 2
    assert hint_arguments(HINT.search(text).group(1)) == expected


@pytest.mark.parametrize("argument, bad", [
    (".[triton]", False), (".[gpu]", True), ("./adapters/transformers[serve]", False), ("./adapters/nothing", True),
    ("kvplug[triton]", True), ("kvplug-transformers", True), ("sglang==0.5.23", False), ("hypothesis>=6.80", False),
    ("flash-attn-3", True),
])
def test_problem_tells_real_hints_from_ones_pointing_nowhere(argument, bad):
    assert (problem(argument) is not None) == bad


def test_no_install_hint_points_nowhere():
    bad = [line for f in scanned_files() if f not in CORE_PENDING for line in hints_pointing_nowhere(f)]
    assert bad == [], "\n".join(bad)


def test_no_install_hint_points_nowhere_in_the_core_files():
    bad = [line for f in sorted(CORE_PENDING) for line in hints_pointing_nowhere(f)]
    assert bad == [], "\n".join(bad)
