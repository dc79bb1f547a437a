"""CPU time a server's processes spent, read from ``/proc`` (Linux), for ``kvplug bench serve``.

A streaming server's HTTP process is one interpreter: its CPU per output token bounds what it can
stream (about one second of CPU per second of wall time), so the benchmark reports it beside the
throughput. ``kvplug serve --engine-process`` runs the engine in a child process: the server's own
process is the HTTP side, its descendants the engine side, except the other API servers of
``--api-server-count`` (named ``kvplug-api-N``), which are HTTP side too.

The benchmark client is Python too, parsing every streamed chunk: ``ClientCpu`` is its own CPU over
the same stretch (``getrusage`` of each client process), so a reader sees when the client, not the
server, is the bound.
"""

from __future__ import annotations

import os
import resource
from typing import NamedTuple

from kvplug.interface import KVPlugError

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
API_SERVER_PREFIX = "kvplug-api-"  # kvplug serve --api-server-count's other HTTP processes (their /proc comm)


class ProcessCpu(NamedTuple):
    """CPU seconds (user + system, every thread) of a process (with the other API servers of
    ``--api-server-count`` among its descendants) and of its other descendants."""

    own_s: float
    descendants_s: float

    def __sub__(self, earlier: "ProcessCpu") -> "ProcessCpu":  # type: ignore[override]
        return ProcessCpu(self.own_s - earlier.own_s, self.descendants_s - earlier.descendants_s)


class CpuPerToken(NamedTuple):
    """A measured stretch: the CPU of the server's processes over it, per output token."""

    http_s: float
    engine_s: float
    output_tokens: int

    @property
    def http_us_per_token(self) -> float:
        return 1e6 * self.http_s / self.output_tokens if self.output_tokens else float("nan")

    @property
    def engine_us_per_token(self) -> float:
        return 1e6 * self.engine_s / self.output_tokens if self.output_tokens else float("nan")

    def to_json(self) -> dict:
        return {
            "http_cpu_s": self.http_s,
            "engine_cpu_s": self.engine_s,
            "output_tokens": self.output_tokens,
            "http_cpu_us_per_token": self.http_us_per_token,
            "engine_cpu_us_per_token": self.engine_us_per_token,
        }


class ClientCpu(NamedTuple):
    """A measured stretch: the CPU of the benchmark's client processes over it (``coordinator_s``:
    the parent that waits on ``--client-processes`` workers; 0 when it drives the requests itself)."""

    process_s: tuple[float, ...]
    coordinator_s: float
    wall_s: float
    output_tokens: int

    @property
    def total_s(self) -> float:
        return sum(self.process_s) + self.coordinator_s

    @property
    def us_per_token(self) -> float:
        return 1e6 * self.total_s / self.output_tokens if self.output_tokens else float("nan")

    @property
    def cores(self) -> float:
        """Client cores kept busy: CPU seconds over wall seconds."""
        return self.total_s / self.wall_s if self.wall_s else float("nan")

    def to_json(self) -> dict:
        return {
            "client_processes": len(self.process_s),
            "client_cpu_s": self.total_s,
            "process_cpu_s": list(self.process_s),
            "coordinator_cpu_s": self.coordinator_s,
            "wall_s": self.wall_s,
            "output_tokens": self.output_tokens,
            "client_cpu_us_per_token": self.us_per_token,
            "client_cores": self.cores,
            "process_cores": [s / self.wall_s if self.wall_s else float("nan") for s in self.process_s],
        }


def own_cpu_seconds() -> float:
    """User + system CPU of this process so far (every thread; children not counted)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads); waited-for children are not counted."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 is fields[0]
    return (int(fields[11]) + int(fields[12])) / _TICKS  # fields 14 and 15


def _children(pid: int) -> list[int]:
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as handle:
                children.extend(int(child) for child in handle.read().split())
        except OSError:
            continue
    return children


def process_cpu(pid: int) -> ProcessCpu:
    """The CPU ``pid`` and its live descendants have used so far.

    Raises:
        KVPlugError: ``pid`` is not a live process of this machine (or ``/proc`` is missing).
    """
    try:
        own = _cpu_seconds(pid)
    except (OSError, IndexError, ValueError) as error:
        raise KVPlugError(
            f"cannot read the CPU time of process {pid} from /proc: expected a live process on "
            f"Linux, got {type(error).__name__}: {error}"
        ) from error
    total, stack, seen = 0.0, _children(pid), {pid}
    while stack:
        child = stack.pop()
        if child in seen:
            continue
        seen.add(child)
        try:
            seconds = _cpu_seconds(child)
            if _is_api_server(child):
                own += seconds
            else:
                total += seconds
        except (OSError, IndexError, ValueError):
            continue  # it exited meanwhile
        stack.extend(_children(child))
    return ProcessCpu(own, total)


def _is_api_server(pid: int) -> bool:
    with open(f"/proc/{pid}/comm", encoding="ascii", errors="replace") as handle:
        return handle.read().startswith(API_SERVER_PREFIX)
