"""Fleet benchmark (issue 27): N real ``kvplug serve`` workers on this machine, multi-turn chats routed
by random, round-robin, sticky-session and NVIDIA Dynamo routing (one or two selection-service
replicas reading every worker's KV events); prefix-cache hit rate, TTFT p50/p99, throughput.

    python benchmarks/fleet.py --dynamo-python /tmp/kvplug-dynamo-venv/bin/python \\
        [--workers 2] [--conversations 9] [--turns 3] [--kv-memory 16MiB] [--out fleet.json]

Without ``--dynamo-python`` only the three Dynamo-free policies run. ``bash
scripts/test-dynamo-fleet.sh`` builds a Python with ``ai-dynamo-runtime==1.6.1``. The workers serve
the embedded model (``--model PATH`` for another); the requests go in waves, turn 1 of every
conversation, then turn 2 of every conversation, ..., ``--concurrency`` at a time, so a worker's
small pool (``--kv-memory``) must choose what to keep, as a busy server must. The Dynamo policies
tokenise each request on a worker (``/tokenize``), ask ``/select_and_reserve`` of the replicas in turn,
report ``prefill_complete`` at the first token and ``DELETE /reservations/{id}`` at the end, as a
gateway does. ``--dynamo-env DYN_NAME=VALUE`` sets Dynamo's router configuration on the replicas
(e.g. ``DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT``, ``DYN_ROUTER_PREFILL_LOAD_SCALE``); ``--trace`` records
what each Dynamo selection saw (overlap scores, potential loads). Between policies every worker's prefix cache is
flushed (``POST /flush_cache``: Dynamo hears ``AllBlocksCleared``), so each policy starts cold.

Hit rate is cached prompt tokens over prompt tokens, from the workers' own ``/kvplug/stats``
(``cache_hit_tokens`` / ``queried_tokens``); ``sticky`` (each conversation pinned to one worker)
is the bound a router can reach without moving KV between workers. Dynamo's services listen on
0.0.0.0 without authentication: run this on a machine you trust.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = 16


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def call(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw[:1] in (b"{", b"[") else {"raw": raw.decode()}
    except urllib.error.HTTPError as error:
        return error.code, {"raw": error.read().decode(errors="replace")}


def wait_for(url: str, process: subprocess.Popen | None, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            sys.exit(f"fleet: {what} exited with {process.returncode}")
        try:
            if call(url, timeout=5)[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.3)
    sys.exit(f"fleet: {what} did not answer at {url} within {timeout:.0f} s")


class Worker:
    def __init__(self, number: int, args: argparse.Namespace, logs: Path) -> None:
        self.id = number + 1
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.events_port}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"}
        argv = [sys.executable, "-m", "kvplug", "serve", "--port", str(self.port), "--kv-memory", args.kv_memory,
                "--max-seq-len", str(args.max_seq_len), "--page-size", str(PAGE), "--max-running-reqs", "4",
                "--stats-interval", "0", "--kv-events-config", json.dumps(config)]
        if args.model:
            argv.append(args.model)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_worker), HF_HUB_OFFLINE="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(REPO / "adapters/transformers"),
                                                          env.get("PYTHONPATH")]))
        with open(logs / f"worker{self.id}.log", "wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict:
        return call(f"{self.url}/kvplug/stats")[1]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


class Dynamo:
    """``replicas`` selection services, each reading every worker's events (as two gateways would) and
    sharing the load of what it placed with the others."""

    def __init__(self, python: str, replicas: int, workers: list[Worker], model: str, logs: Path,
                 override: dict | None = None, router_env: dict | None = None) -> None:
        self.ports = [free_port() for _ in range(replicas)]
        sync_ports = [free_port() for _ in range(replicas)]
        self.processes = []
        for number, port in enumerate(self.ports):
            argv = [python, "-m", "dynamo.select_service", "--port", str(port), "--threads", "1"]
            if replicas > 1:  # the replicas share the load of the requests each one placed (Dynamo's replica sync)
                peers = ",".join(f"tcp://127.0.0.1:{peer}" for other, peer in enumerate(sync_ports) if other != number)
                argv += ["--replica-sync-port", str(sync_ports[number]), "--replica-sync-peers", peers]
            with open(logs / f"select_service{number}.log", "wb") as log:
                self.processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                       env=dict(os.environ, **(router_env or {}))))
        try:
            for port, process in zip(self.ports, self.processes):
                wait_for(f"http://127.0.0.1:{port}/health", process, "dynamo.select_service", timeout=60)
                for worker in workers:
                    status, body = call(f"http://127.0.0.1:{port}/workers", {
                        "worker_id": worker.id, "endpoint": worker.url, "model_name": model, "block_size": PAGE,
                        "kv_events_endpoints": {"0": f"tcp://127.0.0.1:{worker.events_port}"},
                        "replay_endpoint": f"tcp://127.0.0.1:{worker.replay_port}"})
                    if status not in (200, 201):
                        sys.exit(f"fleet: registering worker {worker.id} with Dynamo failed: {body}")
        except BaseException:
            self.stop()
            raise
        self.model = model
        self.override = override or {}
        self.turn = 0
        self.lock = threading.Lock()

    def reserve(self, token_ids: list[int], replicas: int, trace: dict | None = None) -> tuple[int, int, int]:
        """(worker id, the replica that chose it, the reservation): ``/select_and_reserve`` counts the
        request against the worker's load until ``release``, as a gateway does."""
        with self.lock:
            replica = self.turn % replicas  # requests alternate between the router replicas
            self.turn += 1
        port = self.ports[replica]
        if trace is not None:  # what the replica sees just before it selects (Dynamo's inspection APIs)
            query = {"token_ids": token_ids, "model_name": self.model}
            trace["overlap_scores"] = call(f"http://127.0.0.1:{port}/overlap_scores", query)[1]
            trace["potential_loads"] = call(f"http://127.0.0.1:{port}/potential_loads", query)[1]
        request = {"token_ids": token_ids, "model_name": self.model}
        if self.override:
            request["router_config_override"] = self.override
        status, body = call(f"http://127.0.0.1:{port}/select_and_reserve", request)
        if status != 200:
            sys.exit(f"fleet: Dynamo's /select_and_reserve failed: {body}")
        if trace is not None:
            trace["selection"] = body
        return body["worker_id"], replica, body["selection_id"]

    def overlap(self, token_ids: list[int], replica: int) -> dict:
        """Blocks of ``token_ids`` each worker holds, as ``replica``'s indexer sees them now."""
        _, body = call(f"http://127.0.0.1:{self.ports[replica]}/overlap_scores",
                       {"token_ids": token_ids, "model_name": self.model})
        return {row["worker_id"]: row["device_blocks"] for row in body.get("workers", [])}

    def prefill_complete(self, replica: int, selection_id: str) -> None:
        """The request's first token arrived: Dynamo moves its load from prefill to decode (its
        lifecycle API; without it the prompt counts as pending prefill until ``release``)."""
        status, body = call(f"http://127.0.0.1:{self.ports[replica]}/reservations/{selection_id}/prefill_complete", {})
        if status not in (200, 204):
            sys.exit(f"fleet: Dynamo's prefill_complete failed ({status}): {body}")

    def release(self, replica: int, selection_id: str) -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{self.ports[replica]}/reservations/{selection_id}",
                                         method="DELETE")
        with urllib.request.urlopen(request, timeout=30):
            pass

    def stop(self) -> None:
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def streamed_chat(worker: Worker, messages: list, max_tokens: int,
                  on_first_token=None) -> tuple[str, float, float]:
    """(reply text, time to first token, total time), in seconds, over a streamed completion;
    ``on_first_token()`` runs when the first token arrives (a gateway reports prefill done then)."""
    connection = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=300)
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "stream": True})
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        sys.exit(f"fleet: worker {worker.id} answered {response.status}: {response.read()[:500]!r}")
    first, text = None, []
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        choice = (chunk.get("choices") or [{}])[0]
        if "content" not in choice.get("delta", {}) and not choice.get("finish_reason"):
            continue  # the opening {"role": "assistant"} chunk comes before any token
        if first is None:  # the first token, even one whose text is empty (a byte inside a UTF-8 character)
            first = time.perf_counter() - started
            if on_first_token is not None:
                on_first_token()
        text.append(choice.get("delta", {}).get("content") or "")
    connection.close()
    total = time.perf_counter() - started
    return "".join(text), first if first is not None else total, total


def router_env(pairs: list[str]) -> dict:
    """``DYN_NAME=VALUE`` pairs as an environment; anything else stops the run."""
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.startswith("DYN_"):
            sys.exit(f"fleet: --dynamo-env takes DYN_NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def conversations(count: int, seed: int) -> list[list[str]]:
    """Each conversation's user messages; names lead, so that no two share a page."""
    rng = random.Random(seed)
    words = ["radix", "paged", "graph", "kernel", "router", "tensor", "cache", "prefix", "memory", "stream",
             "decode", "batch"]
    chats = []
    for number in range(count):
        topic = " ".join(rng.sample(words, 3))
        chats.append([f"{number} {topic}: " + f"tell me about {topic}, in detail. " * 6,
                      *[f"Turn {turn}: go on about {topic} with an example. " * 3 for turn in range(2, 12)]])
    return chats


def run_policy(policy: str, workers: list[Worker], dynamo: Dynamo | None, replicas: int, args) -> dict:
    for worker in workers:
        status, body = call(f"{worker.url}/flush_cache", {})
        if status != 200:
            sys.exit(f"fleet: flushing worker {worker.id} failed: {body}")
    time.sleep(0.5)  # the flushes' AllBlocksCleared reach Dynamo
    rng = random.Random(args.seed)
    chats = conversations(args.conversations, args.seed)
    histories: list[list[dict]] = [[] for _ in chats]
    before = {worker.id: worker.stats() for worker in workers}
    ttfts, chosen, traces = [], [], []
    lock = threading.Lock()

    def one_turn(number: int, turn: int, worker: Worker | None) -> None:
        history = histories[number] + [{"role": "user", "content": chats[number][turn]}]
        reservation = trace = None
        if worker is None:  # Dynamo: tokenised as the workers will, then selected and reserved
            status, tokenized = call(f"{workers[0].url}/tokenize", {"messages": history})
            trace = {"conversation": number, "turn": turn, "prompt_tokens": len(tokenized["tokens"]),
                     "sent": time.time()} if args.trace else None
            picked, replica, selection = dynamo.reserve(tokenized["tokens"], replicas, trace)
            if trace is not None:
                with lock:
                    traces.append(trace)
            worker, reservation = next(w for w in workers if w.id == picked), (replica, selection)
        def first_token() -> None:  # a gateway's lifecycle call: the prompt is computed
            dynamo.prefill_complete(*reservation)
            if trace is not None:  # whether the prompt's pages reached the router by its first token
                trace["at_first_token"] = dynamo.overlap(tokenized["tokens"], reservation[0])

        reply, ttft, _ = streamed_chat(worker, history, args.max_tokens, first_token if reservation else None)
        if reservation is not None:
            dynamo.release(*reservation)
        with lock:
            ttfts.append(ttft)
            chosen.append(worker.id)
        histories[number] = history + [{"role": "assistant", "content": reply}]

    started = time.perf_counter()
    placed = 0
    with ThreadPoolExecutor(args.concurrency) as pool:
        for turn in range(args.turns):  # a wave per turn: every conversation's turn, concurrency at a time
            futures = []
            for number in range(len(chats)):
                if policy == "random":
                    worker = rng.choice(workers)
                elif policy == "round-robin":
                    worker = workers[placed % len(workers)]
                elif policy == "sticky":
                    worker = workers[number % len(workers)]
                else:
                    worker = None
                placed += 1
                futures.append(pool.submit(one_turn, number, turn, worker))
            for future in futures:
                future.result()
            time.sleep(args.gap)  # the wave's last events reach the routers
    elapsed = time.perf_counter() - started
    after = {worker.id: worker.stats() for worker in workers}
    hit = sum(after[w]["cache_hit_tokens"] - before[w]["cache_hit_tokens"] for w in after)
    queried = sum(after[w]["queried_tokens"] - before[w]["queried_tokens"] for w in after)
    ordered = sorted(ttfts)
    return {
        "policy": policy if policy != "dynamo" else f"dynamo x{replicas}",
        "requests": len(ttfts), "hit_rate": hit / queried if queried else 0.0,
        "cached_tokens": hit, "prompt_tokens": queried,
        "ttft_p50_ms": 1000 * statistics.median(ordered),
        "ttft_p99_ms": 1000 * ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))],
        "requests_per_s": len(ttfts) / elapsed,
        "per_worker": {str(w): chosen.count(w) for w in sorted(set(chosen))},
        "evicted_tokens": sum(after[w]["evicted_tokens"] - before[w]["evicted_tokens"] for w in after),
        **({"trace": traces} if args.trace else {}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=9)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-memory", default="16MiB",
                        help="each worker's KV pool: its share of the conversations fits, all of them do not")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--model", help="a local checkpoint (default: the embedded model)")
    parser.add_argument("--dynamo-python", help="a Python with ai-dynamo-runtime==1.6.1 (default: no Dynamo policy)")
    parser.add_argument("--policies", default="random,round-robin,sticky,dynamo1,dynamo2")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between waves (events reach the routers)")
    parser.add_argument("--dynamo-env", action="append", default=[], metavar="DYN_NAME=VALUE",
                        help="Dynamo's router configuration for the selection services, as its environment variables "
                             "(repeatable), e.g. DYN_ROUTER_PREFILL_LOAD_SCALE=4")
    parser.add_argument("--router-config-override", default="{}",
                        help="Dynamo's per-request router_config_override (JSON), e.g. '{\"overlap_score_credit\": 2}'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="store_true",
                        help="record, per Dynamo request, the replica's overlap scores and potential loads")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="kvplug-fleet-"))
    workers = [Worker(number, args, logs) for number in range(args.workers)]
    dynamo = None
    try:
        for worker in workers:
            wait_for(f"{worker.url}/health", worker.process, f"worker {worker.id}")
        model = workers[0].stats()["model"]
        policies = [policy for policy in args.policies.split(",") if policy]
        if any(policy.startswith("dynamo") for policy in policies):
            if not args.dynamo_python:
                print("fleet: no --dynamo-python: the Dynamo policies are skipped", file=sys.stderr)
                policies = [policy for policy in policies if not policy.startswith("dynamo")]
            else:
                dynamo = Dynamo(args.dynamo_python, 2, workers, model, logs, json.loads(args.router_config_override),
                                router_env(args.dynamo_env))
        results = []
        for policy in policies:
            replicas = int(policy[len("dynamo"):] or 1) if policy.startswith("dynamo") else 0
            result = run_policy("dynamo" if replicas else policy, workers, dynamo, replicas, args)
            results.append(result)
            print(f"{result['policy']:<12} hit rate {result['hit_rate']:.3f}  TTFT p50 {result['ttft_p50_ms']:7.1f} ms"
                  f"  p99 {result['ttft_p99_ms']:7.1f} ms  {result['requests_per_s']:.2f} req/s  "
                  f"requests per worker {result['per_worker']}", flush=True)
    finally:
        if dynamo is not None:
            dynamo.stop()
        for worker in workers:
            worker.stop()
    report = {"workers": args.workers, "conversations": args.conversations, "turns": args.turns,
              "concurrency": args.concurrency, "dynamo_env": router_env(args.dynamo_env),
              "router_config_override": json.loads(args.router_config_override), "gap_s": args.gap,
              "kv_memory": args.kv_memory, "max_tokens": args.max_tokens, "model": args.model or "embedded",
              "machine": os.uname().nodename, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
              "results": results}
    print(f"fleet: worker and router logs in {logs}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
