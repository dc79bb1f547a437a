"""Fingerprints of a host's private names: how an adapter's version gate sees that the host changed.

Every adapter lists the host internals it patches, reads, calls or implements in one table of
``HostInternal`` entries, each pinned to what ``fingerprint`` gives for the release the adapter was
written against. At install the adapter recomputes them (``drifted``) and refuses, naming each
entry that changed: a silent mismatch would corrupt the KV cache rather than fail. This module is
the one implementation of those checks; the tables, the version rules and the error types stay in
each adapter (``kvplug_transformers.compat``, ``kvplug_vllm.compat``). Nothing here imports a host:
``resolve`` imports what an entry names, when it is checked.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

# how a fingerprint is taken (``HostInternal.check``)
PARAMETERS = "parameters"  # the parameter names of the function, in order (``*args``, ``**kwargs`` marked)
SOURCE = "source"  # the first 16 hex digits of the SHA-256 of its dedented source
RETURNS = "returns"  # the expressions its ``return`` statements hand back: what tuple position N holds
ASSIGNED = "assigned"  # a method of the class ``owner`` sets ``self.<attribute>``
FIELDS = "fields"  # the dataclass (or msgspec Struct) ``owner.attribute`` has each listed field
INTERFACE = "interface"  # hash of every method's name and parameters of the class ``owner.attribute``
MEMBERS = "members"  # the names of the enum ``owner.attribute``'s members, in order
VALUE = "value"  # ``repr`` of the constant ``owner.attribute``
CHECKS = (PARAMETERS, SOURCE, RETURNS, ASSIGNED, FIELDS, INTERFACE, MEMBERS, VALUE)

MISSING = "missing"  # the fingerprint of a name that is gone
ORIGINAL_ATTRIBUTE = "__kvplug_original__"  # set on each replacement an adapter installs: what it replaced


@dataclass(frozen=True)
class HostInternal:
    """One host internal an adapter touches.

    Attributes:
        owner: dotted path of the module or class holding it.
        attribute: its name in ``owner``.
        kind: how the adapter uses it (``patched``, ``overridden``, ``read``, ``called``,
            ``re-implemented``, ``implemented``: each adapter names its own).
        why: what kvplug needs it for, in a line.
        check: how ``fingerprint`` reads it (one of ``CHECKS``).
        fingerprint: what ``fingerprint`` gives for the pinned release; for ``fields``, the
            comma-separated field names read.
    """

    owner: str
    attribute: str
    kind: str
    why: str
    check: str
    fingerprint: str

    def __post_init__(self) -> None:
        if self.check not in CHECKS:
            raise ValueError(f"unknown fingerprint check {self.check!r} for {self.name}; expected one of {CHECKS}")

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.attribute}"

    @property
    def short_name(self) -> str:
        """The name as the adapter's table shows it (adapters strip their host's package prefix)."""
        return self.name


def resolve(path: str) -> Any:
    """The module or class at dotted ``path`` (the longest importable module prefix, then attributes)."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            target = getattr(target, name)
        return target
    raise ImportError(f"no module in {path!r} imports")


def original(value: Any) -> Any:
    """What a kvplug replacement replaced: the gate checks the host's code, installed or not."""
    while hasattr(value, ORIGINAL_ATTRIBUTE):
        value = getattr(value, ORIGINAL_ATTRIBUTE)
    return value


def function_of(owner: Any, attribute: str) -> Any:
    """The plain function behind ``owner.attribute`` (a function, method, classmethod, staticmethod,
    property getter, or a class's ``__init__``); ``None`` when absent or not code."""
    if isinstance(owner, type):
        value = inspect.getattr_static(owner, attribute, None)
    else:
        value = getattr(owner, attribute, None)
    value = original(value)
    if isinstance(value, (classmethod, staticmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    elif isinstance(value, type):
        value = value.__init__
    value = inspect.unwrap(value) if callable(value) else None
    return value if inspect.isfunction(value) or inspect.ismethod(value) else None


def parameters(function: Any) -> str:
    names = []
    for parameter in inspect.signature(function).parameters.values():
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
        names.append(prefix + parameter.name)
    return ", ".join(names)


def source_hash(text: str) -> str:
    return hashlib.sha256(textwrap.dedent(text).encode()).hexdigest()[:16]


def _returns(function: Any) -> str:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    values = [node.value for node in ast.walk(tree) if isinstance(node, ast.Return) and node.value is not None]
    return " | ".join(_tuple_text(value) for value in values) or "no return value"


def _tuple_text(node: ast.AST) -> str:
    if isinstance(node, ast.Tuple):
        return "(" + ", ".join(ast.unparse(element) for element in node.elts) + ")"
    return ast.unparse(node)


def _assigned(owner: Any, attribute: str) -> str:
    if not isinstance(owner, type):
        return f"{owner!r} is not a class"
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(owner)))):
        if isinstance(node, ast.Assign):
            targets = node.targets
        else:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if (isinstance(target, ast.Attribute) and target.attr == attribute
                    and isinstance(target.value, ast.Name) and target.value.id == "self"):
                return f"self.{attribute} set by the class"
    return f"self.{attribute} not set by the class"


def _fields(value: Any, wanted: str) -> str:
    if dataclasses.is_dataclass(value):
        present = {field.name for field in dataclasses.fields(value)}
    elif hasattr(value, "__struct_fields__"):  # a msgspec Struct
        present = set(value.__struct_fields__)
    else:
        return f"{getattr(value, '__name__', value)} is neither a dataclass nor a msgspec Struct"
    names = [name.strip() for name in wanted.split(",")]
    return ", ".join(name if name in present else f"{name} ({MISSING})" for name in names)


def _interface(cls: type) -> str:
    methods = []
    for name in sorted(vars(cls)):
        value = vars(cls)[name]
        if isinstance(value, type):
            continue  # a nested class is not a method
        function = function_of(cls, name)
        if function is not None:
            methods.append(f"{name}({parameters(function)})")
    return source_hash("\n".join(methods))


def fingerprint(entry: HostInternal, *, runtime_members: Iterable[str] = ()) -> str:
    """``entry``'s fingerprint in the installed host (``"missing"`` when the name is gone).
    ``runtime_members``: enum members the adapter itself adds at run time, left out of ``members``."""
    try:
        owner = resolve(entry.owner)
    except (ImportError, AttributeError):
        return MISSING
    if entry.check == ASSIGNED:
        return _assigned(owner, entry.attribute)
    if entry.check in (FIELDS, INTERFACE, MEMBERS, VALUE):
        if not hasattr(owner, entry.attribute):
            return MISSING
        value = getattr(owner, entry.attribute)
        if entry.check == FIELDS:
            return _fields(value, entry.fingerprint)
        if entry.check == INTERFACE:
            return _interface(value) if isinstance(value, type) else MISSING
        if entry.check == MEMBERS:
            skipped = set(runtime_members)
            members = getattr(value, "__members__", None)
            return MISSING if members is None else ", ".join(name for name in members if name not in skipped)
        return repr(value)
    if entry.check == SOURCE and function_of(owner, entry.attribute) is None:
        # a class attribute holding data: its type is the fingerprint
        value = inspect.getattr_static(owner, entry.attribute, None)
        return "registry-dict" if isinstance(value, dict) else MISSING
    function = function_of(owner, entry.attribute)
    if function is None:
        return MISSING
    if entry.check == PARAMETERS:
        return parameters(function)
    if entry.check == SOURCE:
        return source_hash(inspect.getsource(function))
    return _returns(function)  # RETURNS: ``__post_init__`` admits no other check


def drifted(entries: Sequence[HostInternal], *, runtime_members: Iterable[str] = ()) -> list[tuple[HostInternal, str]]:
    """``(entry, found)`` for every entry whose fingerprint differs from the pinned release's."""
    skipped = tuple(runtime_members)
    found = [(entry, fingerprint(entry, runtime_members=skipped)) for entry in entries]
    return [(entry, now) for entry, now in found if now != entry.fingerprint]


def drift_lines(changes: Sequence[tuple[HostInternal, str]]) -> list[str]:
    """One line per drifted entry, for the adapter's error message."""
    return [f"- {entry.short_name} ({entry.kind}: {entry.why}): {entry.check} expected {entry.fingerprint!r}, "
            f"found {now!r}" for entry, now in changes]


def internals_table_markdown(entries: Sequence[HostInternal], host_label: str, pinned_version: str) -> str:
    """The entries as the Markdown table of an adapter's README (each adapter's test keeps them equal)."""
    rows = [f"| {host_label} | kind | why | fingerprint ({pinned_version}) |", "| --- | --- | --- | --- |"]
    for entry in entries:
        rows.append(f"| `{entry.short_name}` | {entry.kind} | {entry.why.replace('|', chr(92) + '|')} | "
                    f"{entry.check}: `{entry.fingerprint}` |")
    return "\n".join(rows)
