"""``kvplug serve`` under stress (issue 17 items 1-4): SIGTERM under load, a batching worker that
dies anyway, and a bounded soak with a small pool. Real server processes on 127.0.0.1, the real
``openai`` client, bounded client counts and times."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve_process import REPO_ROOT, free_port, get_json, start, stop, wait_ready

SHUTDOWN_TIMEOUT_S = 5.0
EXIT_SLACK_S = 3.0  # interpreter teardown after the bounded stop


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    from kvplug_transformers.embedded_model import ensure_embedded_model

    directory = tmp_path_factory.mktemp("kvplug-cache")
    ensure_embedded_model(directory)
    return directory


def _client(port: int, timeout: float = 60):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=timeout, max_retries=0)


def _outcome(call) -> tuple[str, str]:
    """('ok', finish_reason) or (error type, message)."""
    try:
        return "ok", call()
    except Exception as error:  # the clients record whatever happened; the tests judge it
        return type(error).__name__, str(error)


def _chat(client, content: str, max_tokens: int | None, stream: bool, read_chunks: int | None = None) -> str:
    kwargs = {} if max_tokens is None else {"max_tokens": max_tokens}
    if not stream:
        messages = [{"role": "user", "content": content}]
        reply = client.chat.completions.create(model="kvplug-default", messages=messages, **kwargs)
        return reply.choices[0].finish_reason
    stream_ = client.chat.completions.create(
        model="kvplug-default", messages=[{"role": "user", "content": content}], stream=True, **kwargs
    )
    finish, seen = None, 0
    for chunk in stream_:
        seen += 1
        if read_chunks is not None and seen >= read_chunks:
            stream_.close()  # the client disconnects mid-stream
            return "disconnected"
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    if finish is None:
        raise RuntimeError("the stream ended without a finish_reason")
    return finish


def test_sigterm_under_load_exits_0_in_time_and_answers_everyone(cache_dir, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    process = start(
        ["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "16MiB", "--max-seq-len", "2048",
         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
        cache_dir, log,
    )
    wait_ready(process, port, log)
    client = _client(port)
    with ThreadPoolExecutor(12) as pool:
        futures = [
            pool.submit(_outcome, lambda i=i: _chat(client, f"request {i}", 5_000, stream=i % 2 == 1))
            for i in range(12)
        ]
        time.sleep(2.0)
        assert get_json(port, "/kvplug/stats")[1]["in_flight"] == 12
        code, seconds = stop(process, timeout=SHUTDOWN_TIMEOUT_S + EXIT_SLACK_S)
        outcomes = [future.result(timeout=30) for future in futures]
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert seconds <= SHUTDOWN_TIMEOUT_S + EXIT_SLACK_S
    for kind, detail in outcomes:  # finished, or told why not: never a hang or a bare disconnect
        assert kind == "ok" or "shutting down" in detail, (kind, detail)
    assert any(kind != "ok" for kind, _ in outcomes)  # 5,000 tokens each cannot finish in 5 s on CPU
    assert output.count("kvplug KV pool built") == 1  # no second worker during shutdown
    assert "kvplug serve: stopped" in output and "Traceback" not in output


def test_a_slow_teardown_under_load_still_exits_0_within_the_timeout(cache_dir, tmp_path):
    """Issue 29: the stop overshot --shutdown-timeout under load (13.9 s against 10) in what follows
    the bounded part (the model drop, the last statistics). Here the model drop takes 60 s: the
    process still exits 0 by the timeout, counted from SIGTERM, and says why in the log."""
    timeout = 3.0
    port, log = free_port(), tmp_path / "serve.log"
    process = start(
        [str(REPO_ROOT / "tests" / "serve_with_slow_teardown.py"), "60", "serve", "--port", str(port),
         "--kv-memory", "16MiB", "--max-seq-len", "2048", "--shutdown-timeout", str(timeout)],
        cache_dir, log,
    )
    wait_ready(process, port, log)
    client = _client(port)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_outcome, lambda i=i: _chat(client, f"request {i}", 5_000, stream=i % 2 == 1))
                   for i in range(6)]
        time.sleep(1.0)
        code, seconds = stop(process, timeout=timeout + 10)
        outcomes = [future.result(timeout=30) for future in futures]
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert seconds <= timeout + 0.5, (seconds, output[-4000:])  # the process's own exit, at most
    assert "still stopping at --shutdown-timeout; exiting now" in output, output[-4000:]
    for kind, detail in outcomes:
        assert kind == "ok" or "shutting down" in detail, (kind, detail)


def test_late_requests_during_shutdown_are_refused_and_start_no_worker(cache_dir, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    process = start(
        ["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "16MiB", "--max-seq-len", "2048",
         "--shutdown-timeout", "4"],
        cache_dir, log,
    )
    wait_ready(process, port, log)
    client = _client(port, timeout=20)
    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(_outcome, lambda: _chat(client, "long", 5_000, stream=True)) for _ in range(2)]
        time.sleep(1.0)
        process.send_signal(15)
        time.sleep(0.3)
        late = [pool.submit(_outcome, lambda i=i: _chat(client, f"late {i}", 4, stream=False)) for i in range(4)]
        late_outcomes = [future.result(timeout=30) for future in late]
        [future.result(timeout=30) for future in running]
    code = process.wait(timeout=10)
    output = log.read_text()
    assert code == 0, output[-4000:]
    for kind, detail in late_outcomes:  # the listener is closed (connection refused) or a 503 says why
        assert kind in ("APIConnectionError", "InternalServerError"), (kind, detail)
        assert kind == "APIConnectionError" or "shutting down" in detail
    assert output.count("kvplug KV pool built") == 1


def test_a_dying_worker_fails_running_requests_says_so_and_exits_nonzero(cache_dir, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    process = start(
        [str(REPO_ROOT / "tests" / "serve_with_fault.py"), "40", "serve", "--port", str(port),
         "--kv-memory", "16MiB", "--max-seq-len", "2048"],
        cache_dir, log,
    )
    wait_ready(process, port, log)
    client = _client(port, timeout=30)
    health_after_error: list[int] = []

    def request(i: int) -> tuple[str, str]:
        outcome = _outcome(lambda: _chat(client, f"request {i}", 5_000, stream=i % 2 == 0))
        if outcome[0] != "ok" and not health_after_error:
            try:
                health_after_error.append(get_json(port, "/health", timeout=2)[0])
            except OSError:
                health_after_error.append(-1)
        return outcome

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(request, range(6)))
    code = process.wait(timeout=20)
    output = log.read_text()
    assert code != 0, output[-4000:]
    for kind, detail in outcomes:
        assert kind != "ok" and "injected fault" in detail, (kind, detail)
    assert health_after_error and set(health_after_error) == {503}, health_after_error
    assert "the batching worker died" in output and "injected fault at forward step 40" in output


def test_soak_small_pool_mixed_clients_no_leak_and_clean_stop(cache_dir, tmp_path):
    """48 concurrent clients for at most ~45 s against a 31-page pool: streaming, mid-stream
    disconnects, over-long prompts, huge and absent max_tokens, bad bodies, repeated prefixes."""
    import openai

    port, log = free_port(), tmp_path / "serve.log"
    max_seq_len = 256
    process = start(
        ["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "2MiB", "--max-seq-len", str(max_seq_len),
         "--page-size", "16", "--shutdown-timeout", "8", "--stats-interval", "5", "--log-level", "warning"],
        cache_dir, log,
    )
    wait_ready(process, port, log)
    client = _client(port, timeout=120)
    deadline = time.monotonic() + 45
    counts: dict[str, int] = {}
    problems: list[str] = []
    lock = threading.Lock()

    def one(rng: random.Random) -> None:
        kind = rng.choice(["stream", "stream", "disconnect", "plain", "too_long", "huge", "bad", "prefix"])
        shared = "You are a helpful assistant. " * 3
        try:
            if kind == "stream":
                result = _chat(client, f"s{rng.random()}", rng.choice([4, 16, 64]), stream=True)
                ok = result in ("stop", "length")
            elif kind == "disconnect":
                ok = _chat(client, f"d{rng.random()}", 200, stream=True, read_chunks=rng.randint(1, 5)) in (
                    "disconnected", "stop", "length")
            elif kind == "plain":
                ok = _chat(client, f"p{rng.random()}", rng.choice([1, 8, 32]), stream=False) in ("stop", "length")
            elif kind == "prefix":
                ok = _chat(client, shared + str(rng.randint(0, 3)), 8, stream=rng.random() < 0.5) in ("stop", "length")
            elif kind == "huge":
                max_tokens = rng.choice([10**9, 5_000, None])
                ok = _chat(client, f"h{rng.random()}", max_tokens, stream=rng.random() < 0.5) in ("length", "stop")
            elif kind == "too_long":
                try:
                    _chat(client, "x" * rng.randint(max_seq_len, 3 * max_seq_len), 8, stream=rng.random() < 0.5)
                    ok = False
                except openai.BadRequestError as error:
                    ok = "maximum context length" in str(error)
            else:
                try:
                    client.chat.completions.create(model="kvplug-default", messages=[], max_tokens=rng.choice([0, -1]))
                    ok = False
                except openai.BadRequestError:
                    ok = True
        except Exception as error:  # anything unexpected is a failure of the server under test
            ok, kind = False, f"{kind}: {type(error).__name__}: {error}"
        with lock:
            counts[kind.split(":")[0]] = counts.get(kind.split(":")[0], 0) + 1
            if not ok:
                problems.append(kind)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(12):
            if time.monotonic() > deadline:
                return
            one(rng)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(48)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not any(thread.is_alive() for thread in threads), "a client hung"
    assert not problems, problems[:10]
    assert sum(counts.values()) >= 150, counts

    # afterwards: still serving, nothing held at idle
    assert _chat(client, "after the soak", 4, stream=False) in ("stop", "length")
    time.sleep(0.5)
    status, stats = get_json(port, "/kvplug/stats")
    assert status == 200 and stats["worker"]["alive"] and stats["caches"] == 1, stats
    assert stats["running_requests"] == 0 and stats["in_flight"] == 0, stats
    assert stats["used_pages"] == stats["cached_pages"], stats
    assert stats["admitted_requests"] == stats["finished_requests"], stats
    code, seconds = stop(process, timeout=8 + EXIT_SLACK_S)
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
