"""Shared KV store benchmark (issue 30): store bandwidth and cross-server TTFT, on this machine.

    python benchmarks/remote_kv.py [--store redis|mooncake] [--pages 512] [--page-bytes 65536] [--repeats 5]
        [--context-tokens 8192] [--trials 3] [--out remote_kv.json] [--skip-bandwidth] [--skip-ttft]

1. **Bandwidth** against a ``redis-server`` it starts on 127.0.0.1 (or, ``--store mooncake``, a
   Mooncake master and one memory-lending ``mooncake_client``): ``RemoteKV.store_pages`` /
   ``RemoteKV.load`` (keys, checksummed framing, the store's protocol) and the store's raw ``put`` /
   ``get`` of the same pages, next to a plain copy of the same bytes into a host buffer, same run;
   one warm-up per variant, then the median of ``--repeats``; ratios to the copy.
2. **Cross-server TTFT**: three real ``kvplug serve`` processes on a tiny checkpoint (the embedded
   model with a 16k context): ``writer`` and ``reader`` share the store, ``recompute`` has none.
   The writer computes ``--trials`` shared contexts of ``--context-tokens`` and pushes them out of
   its pool (to host memory and, written through, the store); then each context, with a question,
   goes to the reader (a remote hit), to the recompute server, and a fresh context to the reader
   (a store miss: recompute plus one lookup). TTFT is the first streamed chunk of a
   ``/v1/completions`` request (greedy); the hit's tokens must equal the recompute's.
3. **Admission on the serving thread** (``--skip-admission``): two memory-only backends of the
   embedded model's KV geometry (4 KiB a token, page 16) on the store; the writer pushes a
   ``--context-tokens`` context out to it; then, on a fresh reader each trial, the serving thread's
   time in ``admit`` of the context + one page: *blocking* (no prefetch: the lookup and the get at
   admission), *prefetched* (``prefetch`` when queued, done before the admission: the staged pages
   are copied), and *in flight* (``admit`` right after ``prefetch``: it waits for the reader, at
   most ``remote_kv_prefetch_timeout_s``); and the caller's time in ``prefetch`` (the keys' hashing).
   The reader's pools are touched and its reader thread started first, as in a warm server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = 16
MODEL_NAME = "bench-tiny"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_redis(binary: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    process = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
                                "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, port
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"remote_kv: redis-server did not start on port {port}")
            time.sleep(0.02)


@contextmanager
def store_urls(args: argparse.Namespace, root: Path):
    """(bandwidth URL, TTFT URL) of a store started for this run, stopped afterwards."""
    if args.store == "mooncake":
        sys.path.insert(0, str(REPO))
        from tests.mooncake_server import INSTALLED, SKIP_REASON, mooncake_cluster

        if not INSTALLED:
            sys.exit(f"remote_kv: {SKIP_REASON}")
        with mooncake_cluster(root, segment="2GB") as cluster:
            yield cluster.url, cluster.url  # one keyspace: the two parts use different model names
        return
    if args.redis_server is None:
        sys.exit("remote_kv: redis-server is not installed (apt-get install -y redis-server)")
    redis, port = start_redis(args.redis_server)
    try:
        yield f"redis://127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/1"
    finally:
        redis.terminate()
        redis.wait(timeout=10)


def timed(run, repeats: int) -> float:
    """Median seconds of ``run()`` over ``repeats`` calls, after one warm-up call."""
    run()
    samples = []
    for _ in range(repeats):
        begin = time.perf_counter()
        run()
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def bandwidth(args: argparse.Namespace, url: str) -> dict:
    import torch

    import kvplug
    from kvplug.kv_store import KVNamespace
    from kvplug.kv_store.remote import RemoteKV

    generator = torch.Generator().manual_seed(30)
    source = torch.randint(0, 256, (args.pages, args.page_bytes), dtype=torch.uint8, generator=generator)
    target = torch.empty_like(source)
    pages = [memoryview(source[index].numpy()) for index in range(args.pages)]
    total = args.pages * args.page_bytes
    tokens = [random.Random(30).randrange(256) for _ in range(args.pages * PAGE)]
    manager = kvplug.PluginManager(entry_points=False)
    raw = manager.create_kv_store(url, timeout=30.0)
    remote = RemoteKV(manager.create_kv_store(url, timeout=30.0),
                      KVNamespace(model="bench", layout=f"bytes:{args.page_bytes}", page_size=PAGE, dtype="uint8"))
    raw_keys = [f"bench-raw-{index}" for index in range(args.pages)]

    def checked_load():
        loaded = remote.load(tokens, 0, args.pages)
        assert len(loaded) == args.pages, f"RemoteKV.load returned {len(loaded)} of {args.pages} pages"

    variants = {
        "plain copy (torch copy_ into a host buffer)": lambda: target.copy_(source),
        f"store put ({args.store}, raw)": lambda: raw.put(raw_keys, pages),
        f"store get ({args.store}, raw)": lambda: raw.get(raw_keys),
        "RemoteKV.store_pages (keys + checksum + put)": lambda: remote.store_pages(tokens, pages),
        "RemoteKV.load (get + checksum check)": checked_load,
    }
    results = {}
    for name, run in variants.items():
        seconds = timed(run, args.repeats)
        results[name] = {"seconds": seconds, "gb_per_s": total / seconds / 1e9}
    floor = results["plain copy (torch copy_ into a host buffer)"]["seconds"]
    for entry in results.values():
        entry["x_copy_time"] = entry["seconds"] / floor
    stats = remote.stats
    assert stats.corrupt_pages == 0 and stats.errors_other == 0, stats
    raw.close()
    remote.close()
    print(f"\nstore bandwidth: {args.pages} pages x {args.page_bytes:,} B = {total / 2**20:.1f} MiB per call, "
          f"median of {args.repeats} after a warm-up")
    print(f"{'variant':48} {'ms':>9} {'GB/s':>8} {'x copy time':>12}")
    for name, entry in results.items():
        print(f"{name:48} {entry['seconds'] * 1e3:9.2f} {entry['gb_per_s']:8.2f} {entry['x_copy_time']:12.1f}")
    return {"pages": args.pages, "page_bytes": args.page_bytes, "repeats": args.repeats, "variants": results}


def admission(args: argparse.Namespace, url: str) -> dict:
    import torch

    import kvplug
    from kvplug.memory.model_shape import ModelShape

    shape = ModelShape(4, 4, 2, 64, torch.float32)  # the embedded model on the CPU: 4 KiB of K/V a token
    context = args.context_tokens
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1, 30000) for _ in range(context + PAGE)]
    host = 2 * (context + PAGE) * shape.kv_bytes_per_token()

    def backend():
        return kvplug.create_backend(
            shape, page_size=PAGE, num_pages=2 * (context + PAGE) // PAGE, max_running_reqs=4,
            max_seq_len=context + 4 * PAGE, attention=None, prefix_cache="radix",
            prefix_cache_options={"host_memory": host, "remote_kv": url, "remote_kv_model": f"{MODEL_NAME}-admission",
                                  "remote_kv_prefetch_memory": host})

    writer = backend()
    request = writer.admit(prompt)
    writer.allocate([request])
    writer.pool.kv_buffer.normal_()
    writer.finish(request, computed=True)
    writer.evict_prefix_cache(writer.prefix_cache.size_info.evictable_size)  # to host memory and the store
    assert writer.prefix_cache.flush_remote_kv(60.0)

    def trial(variant: str) -> dict:
        reader = backend()
        cache = reader.prefix_cache
        # a warm server: its pools' memory touched once, its reader thread started (an unrelated prompt)
        reader.pool.kv_buffer.zero_()
        cache.host_pool.buffer.zero_()
        reader.prefetch([0] * PAGE)
        assert cache.flush_prefetches(60.0)
        prefetch_s = None
        if variant != "blocking":
            begin = time.perf_counter()
            assert reader.prefetch(prompt)
            prefetch_s = time.perf_counter() - begin
            if variant == "prefetched":
                assert cache.flush_prefetches(60.0)  # the request waited in the queue meanwhile
        begin = time.perf_counter()
        request = reader.admit(prompt)
        admit_s = time.perf_counter() - begin
        tier = cache.tier_stats()
        reader.finish(request)
        cache.close_remote_kv()
        return {"admit_s": admit_s, "prefetch_call_s": prefetch_s, "matched": request.matched_len,
                "blocking_reads": tier.remote_blocking_reads, "prefetch_hit_tokens": tier.remote_prefetch_hit_tokens,
                "prefetch_timeouts": tier.remote_prefetch_timeouts}

    results = {}
    for variant in ("blocking", "prefetched", "in flight"):
        trial(variant)  # warm-up
        rows = [trial(variant) for _ in range(args.repeats)]
        results[variant] = {
            "admit_s": statistics.median(row["admit_s"] for row in rows),
            "prefetch_call_s": statistics.median(row["prefetch_call_s"] for row in rows) if variant != "blocking" else None,
            "rows": rows,
        }
    print(f"\nadmission of a {context}-token context from the store, serving thread, median of {args.repeats}:")
    for variant, entry in results.items():
        call = entry["prefetch_call_s"]
        matched = sorted({row["matched"] for row in entry["rows"]})
        print(f"{variant:12} admit {entry['admit_s'] * 1e3:8.2f} ms"
              + (f", prefetch call {call * 1e3:6.2f} ms" if call is not None else "") + f", matched {matched}, "
              f"blocking reads {sum(row['blocking_reads'] for row in entry['rows'])}, timeouts "
              f"{sum(row['prefetch_timeouts'] for row in entry['rows'])}")
    writer.prefix_cache.close_remote_kv()
    return {"context_tokens": context, "repeats": args.repeats, "variants": results}


def tiny_checkpoint(root: Path, context: int) -> Path:
    """The serve tests' embedded checkpoint, copied with a context long enough for ``context``."""
    from kvplug_transformers.embedded_model import ensure_embedded_model

    source = ensure_embedded_model(root / "cache")
    target = root / "tiny-16k"
    shutil.copytree(source, target)
    length = max(16384, 2 * context)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = length
    (target / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer_config = target / "tokenizer_config.json"
    if tokenizer_config.exists():
        settings = json.loads(tokenizer_config.read_text())
        settings["model_max_length"] = length
        tokenizer_config.write_text(json.dumps(settings, indent=2))
    return target


class Server:
    def __init__(self, name: str, checkpoint: Path, args: argparse.Namespace, logs: Path, store: str | None):
        self.name, self.port, self.log = name, free_port(), logs / f"{name}.log"
        request_tokens = args.context_tokens + 2 * PAGE + 16
        pool_tokens = request_tokens + request_tokens // 8  # one context at a time: the next evicts it
        kv_bytes_per_token = 2 * 4 * 2 * 64 * 4  # the embedded model: 4 layers, 2 KV heads of 64, float32
        command = [sys.executable, "-m", "kvplug", "serve", str(checkpoint), "--port", str(self.port),
                   "--served-model-name", MODEL_NAME, "--page-size", str(PAGE), "--max-running-reqs", "2",
                   "--max-seq-len", str(request_tokens), "--kv-memory", str(pool_tokens * kv_bytes_per_token),
                   "--host-memory", str(4 * pool_tokens * kv_bytes_per_token), "--stats-interval", "0"]
        if store is not None:
            command += ["--remote-kv", store]
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads),
                   KVPLUG_CACHE_DIR=str(logs / "cache"))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(REPO / "adapters" / "transformers"),
                                                          env.get("PYTHONPATH")]))
        with open(self.log, "wb") as sink:
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)

    def stats(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/kvplug/stats", timeout=30) as response:
            return json.load(response)

    def wait(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                sys.exit(f"remote_kv: {self.name} exited with {self.process.returncode}:\n"
                         f"{self.log.read_text()[-3000:]}")
            try:
                self.stats()
                return
            except OSError:
                time.sleep(0.3)
        sys.exit(f"remote_kv: {self.name} did not answer within {timeout:.0f} s")

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[float, float, str]:
        """(TTFT, total seconds, generated text) of one streamed greedy completion."""
        body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True}).encode()
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        begin = time.perf_counter()
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            sys.exit(f"remote_kv: {self.name} answered {response.status}: {response.read()[:500]!r}")
        first, text = None, []
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices:  # a token's text may be empty (a byte-level token inside a UTF-8 character)
                first = first if first is not None else time.perf_counter() - begin
                text.append(choices[0].get("text") or "")
        total = time.perf_counter() - begin
        connection.close()
        if first is None:
            sys.exit(f"remote_kv: {self.name} streamed no choice")
        return first, total, "".join(text)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def ttft(args: argparse.Namespace, store: str, root: Path) -> dict:
    checkpoint = tiny_checkpoint(root, args.context_tokens)
    servers = {"writer": Server("writer", checkpoint, args, root, store),
               "reader": Server("reader", checkpoint, args, root, store),
               "recompute": Server("recompute", checkpoint, args, root, None)}
    try:
        for server in servers.values():
            server.wait()
        rng = random.Random(args.seed)

        def tokens(count: int) -> list[int]:
            return [rng.randrange(3, 256) for _ in range(count)]

        contexts = [tokens(args.context_tokens) for _ in range(args.trials)]
        questions = [tokens(16) for _ in range(args.trials)]
        for server in servers.values():  # warm-up per server: first-request costs out of the figures
            server.complete(tokens(1024), 2)
        writer = servers["writer"]
        for context in contexts + [tokens(args.context_tokens), tokens(args.context_tokens)]:  # two fillers
            writer.complete(context, 1)
        written = writer.stats()
        need = args.trials * (args.context_tokens // PAGE)
        if written["remote_written_pages"] < need or written["remote_errors"]:
            sys.exit(f"remote_kv: the writer stored {written['remote_written_pages']} pages (< {need}): {written}")
        rows = []
        for trial in range(args.trials):
            prompt = contexts[trial] + questions[trial]
            before = servers["reader"].stats()["remote_hit_tokens"]
            hit = servers["reader"].complete(prompt, args.output_tokens)
            hit_tokens = servers["reader"].stats()["remote_hit_tokens"] - before
            recompute = servers["recompute"].complete(prompt, args.output_tokens)
            miss = servers["reader"].complete(tokens(args.context_tokens) + questions[trial], args.output_tokens)
            rows.append({"hit_ttft_s": hit[0], "recompute_ttft_s": recompute[0], "store_miss_ttft_s": miss[0],
                         "hit_total_s": hit[1], "recompute_total_s": recompute[1],
                         "remote_hit_tokens": hit_tokens, "token_identical": hit[2] == recompute[2]})
            print(f"trial {trial}: hit {hit[0] * 1e3:.0f} ms ({hit_tokens} tokens from the store), recompute "
                  f"{recompute[0] * 1e3:.0f} ms, store miss {miss[0] * 1e3:.0f} ms, identical {hit[2] == recompute[2]}")
        reader = servers["reader"].stats()
    finally:
        for server in servers.values():
            server.stop()
    summary = {key: statistics.median(row[key] for row in rows)
               for key in ("hit_ttft_s", "recompute_ttft_s", "store_miss_ttft_s")}
    summary["hit_over_recompute"] = summary["hit_ttft_s"] / summary["recompute_ttft_s"]
    summary["all_token_identical"] = all(row["token_identical"] for row in rows)
    summary["all_hits_whole"] = all(row["remote_hit_tokens"] >= args.context_tokens for row in rows)
    print(f"\ncross-server TTFT, {args.context_tokens}-token shared context + 16-token question, median of "
          f"{args.trials}: remote hit {summary['hit_ttft_s'] * 1e3:.0f} ms, recompute "
          f"{summary['recompute_ttft_s'] * 1e3:.0f} ms (ratio {summary['hit_over_recompute']:.2f}), store miss "
          f"{summary['store_miss_ttft_s'] * 1e3:.0f} ms; token-identical {summary['all_token_identical']}, "
          f"whole context from the store {summary['all_hits_whole']}")
    return {"context_tokens": args.context_tokens, "trials": rows, "summary": summary,
            "reader_stats": {key: value for key, value in reader.items() if key.startswith(("remote_", "host_"))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=("redis", "mooncake"), default="redis")
    parser.add_argument("--redis-server", default=shutil.which("redis-server"))
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--page-bytes", type=int, default=65536, help="the embedded model's page: 16 tokens x 4 KiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context-tokens", type=int, default=8192)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per server")
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--skip-bandwidth", action="store_true")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-admission", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"machine": f"{os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d", time.gmtime()), "store": args.store}
    with tempfile.TemporaryDirectory(prefix="kvplug-remote-kv-bench-") as root, store_urls(args, Path(root)) as urls:
        if not args.skip_bandwidth:
            result["bandwidth"] = bandwidth(args, urls[0])
        if not args.skip_admission:
            result["admission"] = admission(args, urls[0])
        if not args.skip_ttft:
            result["ttft"] = ttft(args, urls[1], Path(root))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
