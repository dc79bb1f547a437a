"""``kvplug bench serve --client-processes N``: the conversations over N client processes, because one
interpreter parsing every streamed chunk through the ``openai`` client can bound the run, not the server.

Each process (``spawn``) runs its own event loop and ``AsyncOpenAI`` client over every N-th
conversation, with its share of ``--max-concurrency`` and of ``--request-rate``. All start together
once every one has connected and resolved the model, so start-up is not measured; the wall time runs
from that common start to the last finish. A process that dies ends the run with its name.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import queue
import time
from typing import Any, NamedTuple

from kvplug.bench.process_cpu import own_cpu_seconds
from kvplug.bench.serve import Drive, Progress, RequestRecord, drive_requests

_POLL_S = 0.5


class ClientShare(NamedTuple):
    """What one client process sends: its conversations, in-flight cap and request rate."""

    chats: list[list[str]]
    max_concurrency: int
    request_rate: float


def split_clients(chats: list[list[str]], max_concurrency: int, request_rate: float,
                  processes: int) -> list[ClientShare]:
    """Conversations dealt in turn; the cap split as evenly as possible; each process the share of
    the rate that its conversations are of all (an infinite rate stays infinite)."""
    if processes < 1 or processes > min(max_concurrency, len(chats)):
        raise ValueError(f"--client-processes {processes} needs 1 to min(--max-concurrency, conversations) = "
                         f"{min(max_concurrency, len(chats))} processes")
    base, extra = divmod(max_concurrency, processes)
    shares = []
    for index in range(processes):
        mine = chats[index::processes]
        rate = request_rate if math.isinf(request_rate) else request_rate * len(mine) / len(chats)
        shares.append(ClientShare(mine, base + (index < extra), rate))
    return shares


def _plain(args: argparse.Namespace) -> argparse.Namespace:
    """The options a client process needs (the CLI's namespace also holds modules and parsers)."""
    return argparse.Namespace(**{key: value for key, value in vars(args).items()
                                 if isinstance(value, (str, int, float, bool, list, tuple, type(None)))})


def _client(index: int, base_url: str, args: argparse.Namespace, share: ClientShare, results: Any,
            start: Any, done: Any) -> None:
    async def wait_for_start() -> None:
        results.put(("ready", index, None))
        await asyncio.to_thread(start.wait)

    def count() -> None:
        with done.get_lock():
            done.value += 1

    mine = argparse.Namespace(**{**vars(args), "max_concurrency": share.max_concurrency,
                                 "request_rate": share.request_rate})
    drive = asyncio.run(drive_requests(base_url, mine, share.chats, progress=False, delay_seed=(args.seed, index),
                                       before_start=wait_for_start, on_request=count))
    results.put(("done", index, drive))


class ClientProcesses:
    """``with ClientProcesses(...) as clients``: the processes are started and connected;
    ``clients.run()`` releases them together and merges what they measured."""

    def __init__(self, base_url: str, args: argparse.Namespace, chats: list[list[str]], processes: int) -> None:
        self.shares = split_clients(chats, args.max_concurrency, args.request_rate, processes)
        self.total = sum(len(chat) for chat in chats)
        self.startup_timeout = args.startup_timeout
        context = multiprocessing.get_context("spawn")
        self.results, self.start, self.done = context.Queue(), context.Event(), context.Value("i", 0)
        self.processes = [
            context.Process(target=_client, name=f"kvplug-bench-client-{index + 1}", daemon=True,
                            args=(index, base_url, _plain(args), share, self.results, self.start, self.done))
            for index, share in enumerate(self.shares)]

    def __enter__(self) -> "ClientProcesses":
        try:
            for process in self.processes:
                process.start()
            self._collect("ready", time.monotonic() + self.startup_timeout)
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def run(self) -> tuple[list[RequestRecord], float, tuple[float, ...], float]:
        """The merged records, the wall seconds from the common start to the last finish, each
        process's CPU seconds and this (waiting, progress-printing) process's."""
        cpu, started = own_cpu_seconds(), time.monotonic()
        self.start.set()
        drives: list[Drive] = self._collect("done", None, Progress(self.total))
        coordinator_s = own_cpu_seconds() - cpu
        records = [record for drive in drives for record in drive.records]
        return records, max(drive.finished for drive in drives) - started, tuple(d.cpu_s for d in drives), coordinator_s

    def _collect(self, kind: str, deadline: float | None, progress: Progress | None = None) -> list:
        """Every process's ``kind`` message, in process order; a process that exits without it is an error."""
        got: dict[int, Any] = {}
        while len(got) < len(self.processes):
            try:
                _, index, payload = self.results.get(timeout=_POLL_S)
                got[index] = payload
            except queue.Empty:
                self._check_alive(got, kind)
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"client processes not {kind} within {self.startup_timeout:.0f} s") from None
            if progress is not None:
                progress.update(self.done.value)
        if progress is not None:
            progress.close()
        return [got[index] for index in range(len(self.processes))]

    def _check_alive(self, got: dict[int, Any], kind: str) -> None:
        for index, process in enumerate(self.processes):
            if index not in got and not process.is_alive():
                try:  # its last message may still be in the pipe
                    _, late, payload = self.results.get(timeout=_POLL_S)
                    got[late] = payload
                    return
                except queue.Empty:
                    raise RuntimeError(
                        f"client process {process.name} ({index + 1} of {len(self.processes)}, pid {process.pid}) "
                        f"exited with code {process.exitcode} before it was {kind}; its traceback, if any, is "
                        f"above") from None

    def _stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
            if process.pid is not None:
                process.join()
