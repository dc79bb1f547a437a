"""Drive a running OpenAI-compatible server the way users do: ``kvplug bench serve``.

``kvplug bench serve --base-url http://127.0.0.1:8000/v1`` sends chat completions through the
``openai`` client (streaming unless ``--no-stream``) and reports TTFT, TPOT, ITL and end-to-end
latency (p50 / p90 / p99), request and output-token throughput. ``--serve-args "ARGS"`` (repeat
it for an A/B in one run) starts ``kvplug serve ARGS`` on a free loopback port for each side in
turn, warms it up, measures it and stops it; leading ``NAME=VALUE`` words of ``ARGS`` are set in
that server's environment (``"PYTHONPATH=/tmp/old --engine-process"``: another checkout's server). Datasets:

- ``multi-turn``: ``--conversations`` chats of ``--turns`` turns over one shared system prompt of
  ``--system-chars`` characters; a turn's prompt is the whole conversation so far, so a prefix
  cache serves every turn after the first (the workload of a chat front end);
- ``shared-prefix``: ``--num-prompts`` single questions after the shared system prompt;
- ``random``: ``--num-prompts`` unrelated prompts of ``--question-chars`` characters.

``--max-concurrency`` caps requests in flight; ``--request-rate`` (requests per second, Poisson
arrivals; default: all at once) paces the starts. Lengths are in characters (one token each for
the embedded model's byte-level tokenizer). A request that fails is counted and reported, not
retried. Needs the ``openai`` package (the transformers adapter's ``serve`` extra).

The CPU the server's processes spend over the measured requests (``process_cpu``: its own process,
the HTTP side, and its descendants, the engine of ``--engine-process``) is reported per output
token for a server it starts, or for ``--server-pid`` beside ``--base-url``: a streaming server's
HTTP interpreter is bounded by it. The client's own CPU is reported beside it (per output token and
as client cores busy): one interpreter parsing every streamed chunk can be the bound instead.
``--client-processes N`` splits the conversations over N client processes
(``kvplug.bench.serve_clients``); ``--client-processes 1 2`` measures each server once per count.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Awaitable, Callable, Iterator, NamedTuple

import numpy as np

from kvplug.bench.process_cpu import ClientCpu, CpuPerToken, own_cpu_seconds, process_cpu

SUITE = "serve"
SCHEMA = 1
WORDS = ("page", "table", "cache", "prefix", "token", "kernel", "radix", "tree", "graph", "batch", "stream",
         "memory", "server", "request", "decode", "prefill", "host", "device", "pool", "copy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--base-url", help="a running server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    target.add_argument("--serve-args", action="append", metavar="ARGS",
                        help="start `kvplug serve ARGS` for this side (repeat for an A/B in one run)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    parser.add_argument("--model", default=None, help="model id (default: the server's first)")
    parser.add_argument("--dataset", choices=("multi-turn", "shared-prefix", "random"), default="multi-turn")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (shared-prefix, random)")
    parser.add_argument("--conversations", type=int, default=48, help="chats (multi-turn)")
    parser.add_argument("--turns", type=int, default=3, help="turns per chat (multi-turn)")
    parser.add_argument("--system-chars", type=int, default=2000, help="shared system prompt length")
    parser.add_argument("--question-chars", type=int, default=100, help="each user message's length")
    parser.add_argument("--output-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--max-concurrency", type=int, default=48, help="requests in flight at most")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (Poisson)")
    parser.add_argument("--no-stream", action="store_true", help="plain responses (TTFT is then the latency)")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent before measuring (per side)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--server-pid", type=int, default=None,
                        help="with --base-url: the server's process id, to report its CPU per output token")
    parser.add_argument("--client-processes", type=_positive_int, nargs="+", default=[1], metavar="N",
                        help="client processes sharing the conversations, in-flight cap and rate (default 1; "
                             "several counts: each server measured once per count)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class RequestRecord(NamedTuple):
    """One request as the client saw it (seconds; ``itl``: gaps between content chunks)."""

    ok: bool
    ttft: float
    latency: float
    output_tokens: int
    itl: tuple[float, ...]
    error: str


class Drive(NamedTuple):
    """One client process's measured requests: wall seconds from its start, its own CPU seconds over
    them, and when it finished (``time.monotonic``, comparable across this machine's processes)."""

    records: list[RequestRecord]
    elapsed: float
    cpu_s: float
    finished: float


class Progress:
    """The ``N/total requests`` line: a terminal redraws it per request, a log (not a TTY) gets a
    line per tenth of the run."""

    def __init__(self, total: int) -> None:
        self.total, self.shown = total, 0
        self.every = 1 if sys.stderr.isatty() else max(1, total // 10)

    def update(self, done: int) -> None:
        if done // self.every > self.shown // self.every or (done == self.total and self.shown < done):
            end = "" if self.every == 1 else "\n"
            print(f"\r  {done}/{self.total} requests", end=end, file=sys.stderr, flush=True)
            self.shown = done

    def close(self) -> None:
        if self.every == 1:
            print(file=sys.stderr)


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    length = 0
    while length < chars:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:chars]


def conversations(args: argparse.Namespace) -> list[list[str]]:
    """The user messages of each conversation (one message each outside ``multi-turn``)."""
    rng = random.Random(args.seed)
    if args.dataset == "multi-turn":
        return [[f"chat {c} turn {t}: " + _text(rng, args.question_chars) for t in range(args.turns)]
                for c in range(args.conversations)]
    return [[f"question {i}: " + _text(rng, args.question_chars)] for i in range(args.num_prompts)]


def system_prompt(args: argparse.Namespace) -> str | None:
    if args.dataset == "random":
        return None
    return _text(random.Random(args.seed + 1), args.system_chars)


async def _one(client: Any, model: str, messages: list[dict], args: argparse.Namespace) -> tuple[RequestRecord, str]:
    start = time.perf_counter()
    try:
        if args.no_stream:
            response = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=args.output_tokens, temperature=0)
            latency = time.perf_counter() - start
            text = response.choices[0].message.content or ""
            tokens = response.usage.completion_tokens if response.usage else len(text)
            return RequestRecord(True, latency, latency, tokens, (), ""), text
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.output_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        first, last, gaps, pieces, usage = None, None, [], [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
                pieces.append(chunk.choices[0].delta.content)
        end = time.perf_counter()
        text = "".join(pieces)
        tokens = usage if usage is not None else len(pieces)
        return RequestRecord(True, (first or end) - start, end - start, tokens, tuple(gaps), ""), text
    except Exception as error:  # counted and reported: one failure must not end the run
        return RequestRecord(False, 0.0, time.perf_counter() - start, 0, (), f"{type(error).__name__}: {error}"), ""


async def drive_requests(base_url: str, args: argparse.Namespace, chats: list[list[str]], progress: bool = True,
                         delay_seed: int | tuple[int, int] | None = None,
                         before_start: Callable[[], Awaitable[None]] | None = None,
                         on_request: Callable[[], None] | None = None) -> Drive:
    """Send ``chats``; ``before_start`` is awaited once the client is connected and has the model
    (a client process waits there for the others), ``on_request`` called after every request."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=600.0)
    model = args.model or (await client.models.list()).data[0].id
    system = system_prompt(args)
    limit = asyncio.Semaphore(max(1, args.max_concurrency))
    rng = np.random.default_rng(args.seed if delay_seed is None else delay_seed)
    records: list[RequestRecord] = []
    shown = Progress(sum(len(chat) for chat in chats)) if progress else None

    async def converse(index: int, turns: list[str], delay: float) -> None:
        await asyncio.sleep(delay)
        messages = [{"role": "system", "content": system}] if system is not None else []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            async with limit:
                record, text = await _one(client, model, messages, args)
            records.append(record)
            messages.append({"role": "assistant", "content": text})
            if shown is not None:
                shown.update(len(records))
            if on_request is not None:
                on_request()

    rate = args.request_rate
    delays = np.zeros(len(chats)) if not np.isfinite(rate) else np.cumsum(rng.exponential(1.0 / rate, len(chats)))
    if before_start is not None:
        await before_start()
    cpu, start = own_cpu_seconds(), time.perf_counter()
    await asyncio.gather(*(converse(i, chat, float(d)) for i, (chat, d) in enumerate(zip(chats, delays))))
    elapsed, cpu, finished = time.perf_counter() - start, own_cpu_seconds() - cpu, time.monotonic()
    if shown is not None:
        shown.close()
    await client.close()
    return Drive(records, elapsed, cpu, finished)


def summarize(records: list[RequestRecord], elapsed: float) -> dict[str, Any]:
    """Percentiles in ms, throughputs per second."""
    good = [record for record in records if record.ok]

    def percentiles(values: list[float]) -> dict[str, float]:
        if not values:
            return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
        array = np.asarray(values) * 1000.0
        return {f"p{q}": float(np.percentile(array, q)) for q in (50, 90, 99)}

    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    output = sum(record.output_tokens for record in good)
    return {
        "requests": len(records), "failed": len(records) - len(good), "seconds": elapsed,
        "request_throughput": len(good) / elapsed if elapsed else 0.0,
        "output_throughput": output / elapsed if elapsed else 0.0,
        "ttft_ms": percentiles([r.ttft for r in good]), "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([gap for r in good for gap in r.itl]),
        "latency_ms": percentiles([r.latency for r in good]),
        "errors": sorted({record.error for record in records if not record.ok})[:5],
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def serve_environment(serve_args: str) -> tuple[dict[str, str], list[str]]:
    """``--serve-args`` split as a shell reads a command line: leading ``NAME=VALUE`` words are
    the server's environment (``PYTHONPATH=/tmp/old`` serves another checkout in an A/B), the rest
    its arguments."""
    words = shlex.split(serve_args)
    environment: dict[str, str] = {}
    while words and _ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        environment[name] = value
    return environment, words


@contextlib.contextmanager
def started_server(serve_args: str, timeout: float) -> Iterator[tuple[str, int]]:
    """``kvplug serve SERVE_ARGS`` on a free loopback port until the block ends; yields its base
    URL and process id."""
    port = _free_port()
    environment, words = serve_environment(serve_args)
    command = [sys.executable, "-m", "kvplug", "serve", *words, "--host", "127.0.0.1", "--port", str(port)]
    log = open(os.path.join(tempfile.gettempdir(), f"kvplug-bench-serve-{port}.log"), "w", encoding="utf-8")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **environment})
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"kvplug serve {serve_args} exited with {process.returncode} (log: {log.name})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvplug serve {serve_args} was not healthy within {timeout:.0f} s (log: {log.name})")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1", process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _measure(base_url: str, args: argparse.Namespace, server_pid: int | None = None,
             client_processes: int = 1) -> dict[str, Any]:
    """The side's summary with the client's CPU over the measured requests (``client_cpu``); with
    ``server_pid``, the server processes' CPU too (``server_cpu``; the warm-up excluded)."""
    from kvplug.bench.serve_clients import ClientProcesses  # it imports this module

    if args.warmup:
        warm = argparse.Namespace(**{**vars(args), "dataset": "random", "num_prompts": args.warmup, "seed": args.seed + 7})
        asyncio.run(drive_requests(base_url, warm, conversations(warm), progress=False))
    if client_processes == 1:
        before = process_cpu(server_pid) if server_pid is not None else None
        drive = asyncio.run(drive_requests(base_url, args, conversations(args)))
        records, elapsed, process_s, coordinator_s = drive.records, drive.elapsed, (drive.cpu_s,), 0.0
    else:
        with ClientProcesses(base_url, args, conversations(args), client_processes) as clients:  # connected
            before = process_cpu(server_pid) if server_pid is not None else None
            records, elapsed, process_s, coordinator_s = clients.run()
    summary = summarize(records, elapsed)
    tokens = sum(record.output_tokens for record in records if record.ok)
    summary["client_cpu"] = ClientCpu(process_s, coordinator_s, elapsed, tokens).to_json()
    if before is not None:
        spent = process_cpu(server_pid) - before
        summary["server_cpu"] = CpuPerToken(spent.own_s, spent.descendants_s, tokens).to_json()
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.conversations, args.turns, args.num_prompts = min(args.conversations, 4), min(args.turns, 2), 4
        args.output_tokens = min(args.output_tokens, 8)
    sides: list[tuple[str, dict[str, Any]]] = []
    counts = args.client_processes

    def named(side: str, count: int) -> str:  # the count first: the table cuts names at 40 characters
        return side if len(counts) == 1 else f"{count} client procs, {side}"

    if args.serve_args:
        for serve_args in args.serve_args:
            with started_server(serve_args, args.startup_timeout) as (base_url, pid):
                for count in counts:
                    sides.append((named(serve_args, count), _measure(base_url, args, pid, count)))
    else:
        base_url = args.base_url or "http://127.0.0.1:8000/v1"
        for count in counts:
            sides.append((named(base_url, count), _measure(base_url, args, args.server_pid, count)))
    print(f"{'side':<40} {'req':>5} {'fail':>4} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} "
          f"{'ITL p50':>8} {'lat p50':>8}")
    for name, result in sides:
        print(f"{name[:40]:<40} {result['requests']:>5} {result['failed']:>4} {result['output_throughput']:>10.1f} "
              f"{result['ttft_ms']['p50']:>9.1f} {result['ttft_ms']['p99']:>8.1f} {result['tpot_ms']['p50']:>9.2f} "
              f"{result['itl_ms']['p50']:>8.2f} {result['latency_ms']['p50']:>8.1f}")
    for name, result in sides:
        cpu = result.get("server_cpu")
        if cpu is not None:
            print(f"{name[:40]:<40} server CPU per output token: HTTP process {cpu['http_cpu_us_per_token']:.1f} us, "
                  f"engine processes {cpu['engine_cpu_us_per_token']:.1f} us ({cpu['output_tokens']} tokens; "
                  f"{cpu['http_cpu_s']:.2f} s / {cpu['engine_cpu_s']:.2f} s)")
    for name, result in sides:
        cpu = result["client_cpu"]
        per_process = " + ".join(f"{cores:.2f}" for cores in cpu["process_cores"])
        print(f"{name[:40]:<40} client CPU per output token: {cpu['client_cpu_us_per_token']:.1f} us; client cores "
              f"{cpu['client_cores']:.2f} ({cpu['client_processes']} processes: {per_process}; "
              f"{cpu['client_cpu_s']:.2f} s over {cpu['wall_s']:.2f} s)")
    ratios = []
    if len(sides) > 1:
        base_name, base = sides[-1]
        for name, result in sides[:-1]:
            ratio = {"side": name, "versus": base_name,
                     "throughput": result["output_throughput"] / base["output_throughput"] if base["output_throughput"] else None,
                     "ttft_p50": result["ttft_ms"]["p50"] / base["ttft_ms"]["p50"] if base["ttft_ms"]["p50"] else None}
            ratios.append(ratio)
            print(f"{name} / {base_name}: throughput {ratio['throughput']:.2f}x, TTFT p50 {ratio['ttft_p50']:.2f}x")
    settings = {key: value for key, value in vars(args).items()
                if key not in ("suite_module", "handler", "bench_parser", "suite_import_failures", "api_key")}
    return {"suite": SUITE, "schema": SCHEMA, "settings": settings, "sides": [{"name": n, **r} for n, r in sides],
            "ratios": ratios}
