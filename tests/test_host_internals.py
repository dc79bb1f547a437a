"""``kvplug.host_internals``: each fingerprint check against a small module written here, and the
drift it must notice (a renamed parameter, changed source, a missing field, a gone name)."""

from __future__ import annotations

import dataclasses
import enum
import sys
import importlib
import textwrap

import pytest

from kvplug import host_internals as hi

SOURCE = textwrap.dedent('''
    import dataclasses
    import enum

    LIMIT = 7

    class Colour(enum.Enum):
        RED = 1
        BLUE = 2

    @dataclasses.dataclass
    class Row:
        ids: list
        length: int

    class Engine:
        def __init__(self, size):
            self.size = size

        def step(self, batch, *args, **kwargs):
            return (batch, self.size)

        @classmethod
        def build(cls, config):
            return cls(config)
''')


@pytest.fixture()
def host(tmp_path, monkeypatch):
    (tmp_path / "kvplug_fake_host.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvplug_fake_host", raising=False)
    module = importlib.import_module("kvplug_fake_host")
    yield module
    sys.modules.pop("kvplug_fake_host", None)


def _pinned(owner, attribute, check):
    entry = hi.HostInternal(owner, attribute, "read", "test", check, "?")
    if check == hi.FIELDS:
        entry = dataclasses.replace(entry, fingerprint="ids, length")
    return dataclasses.replace(entry, fingerprint=hi.fingerprint(entry))


def test_each_check_reads_what_it_names(host):
    assert hi.fingerprint(_pinned("kvplug_fake_host.Engine", "step", hi.PARAMETERS)) == "self, batch, *args, **kwargs"
    assert hi.fingerprint(_pinned("kvplug_fake_host.Engine", "step", hi.RETURNS)) == "(batch, self.size)"
    assert hi.fingerprint(_pinned("kvplug_fake_host.Engine", "speed", hi.ASSIGNED)) == "self.speed not set by the class"
    assert hi.fingerprint(_pinned("kvplug_fake_host.Engine", "size", hi.ASSIGNED)) == "self.size set by the class"
    assert hi.fingerprint(_pinned("kvplug_fake_host", "Row", hi.FIELDS)) == "ids, length"
    assert hi.fingerprint(_pinned("kvplug_fake_host", "Colour", hi.MEMBERS)) == "RED, BLUE"
    assert hi.fingerprint(_pinned("kvplug_fake_host", "LIMIT", hi.VALUE)) == "7"
    assert hi.fingerprint(_pinned("kvplug_fake_host.Engine", "build", hi.PARAMETERS)) == "cls, config"
    assert len(hi.fingerprint(_pinned("kvplug_fake_host.Engine", "step", hi.SOURCE))) == 16
    assert len(hi.fingerprint(_pinned("kvplug_fake_host", "Engine", hi.INTERFACE))) == 16


def test_drift_is_named_per_entry(host, monkeypatch):
    entries = [_pinned("kvplug_fake_host.Engine", "step", hi.PARAMETERS),
               _pinned("kvplug_fake_host.Engine", "step", hi.SOURCE),
               _pinned("kvplug_fake_host", "Engine", hi.INTERFACE),
               _pinned("kvplug_fake_host", "Row", hi.FIELDS),
               _pinned("kvplug_fake_host", "Colour", hi.MEMBERS),
               _pinned("kvplug_fake_host", "LIMIT", hi.VALUE)]
    assert hi.drifted(entries) == []

    def step(self, batches, *args, **kwargs):
        return (batches, self.size)

    monkeypatch.setattr(host.Engine, "step", step)
    monkeypatch.setattr(host, "LIMIT", 8)

    @dataclasses.dataclass
    class Row:
        ids: list

    monkeypatch.setattr(host, "Row", Row)
    monkeypatch.setattr(host, "Colour", enum.Enum("Colour", "RED BLUE GREEN"))
    changed = dict((entry.check, found) for entry, found in hi.drifted(entries))
    assert changed[hi.PARAMETERS] == "self, batches, *args, **kwargs"
    assert hi.SOURCE in changed and hi.INTERFACE in changed
    assert changed[hi.FIELDS] == "ids, length (missing)"
    assert changed[hi.MEMBERS] == "RED, BLUE, GREEN"
    assert changed[hi.VALUE] == "8"
    lines = hi.drift_lines(hi.drifted(entries))
    assert len(lines) == 6 and all(line.startswith("- kvplug_fake_host.") for line in lines)
    # a member the adapter adds itself is left out
    assert hi.drifted([entries[4]], runtime_members=("GREEN",)) == []


def test_a_gone_name_is_missing_and_a_replacement_is_seen_through(host, monkeypatch):
    entry = _pinned("kvplug_fake_host.Engine", "step", hi.PARAMETERS)
    original = host.Engine.step

    def patched(self, batch, extra):
        return original(self, batch)

    patched.__kvplug_original__ = original
    monkeypatch.setattr(host.Engine, "step", patched)
    assert hi.drifted([entry]) == []  # the gate checks the host's code, not kvplug's replacement
    monkeypatch.delattr(host.Engine, "step")
    assert hi.drifted([entry]) == [(entry, hi.MISSING)]
    gone = dataclasses.replace(entry, owner="kvplug_fake_host.Nothing")
    assert hi.fingerprint(gone) == hi.MISSING


def test_an_unknown_check_is_refused_and_the_table_escapes_pipes():
    with pytest.raises(ValueError, match="unknown fingerprint check 'hash'"):
        hi.HostInternal("m", "a", "read", "why", "hash", "x")
    entry = hi.HostInternal("m", "a", "read", "a | b", hi.VALUE, "1")
    table = hi.internals_table_markdown([entry], "host name", "host 1.0")
    assert table.splitlines() == ["| host name | kind | why | fingerprint (host 1.0) |", "| --- | --- | --- | --- |",
                                  "| `m.a` | read | a \\| b | value: `1` |"]
