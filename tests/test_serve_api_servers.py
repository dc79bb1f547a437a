"""``kvplug serve --api-server-count N`` (issue 28 item 2): N HTTP processes share the port over one
engine process. Real server processes on 127.0.0.1 with the embedded model: two API servers stream
concurrent clients the greedy answer (what one API server answers), both take requests (each
response names its API server), the guards answer on both, SIGTERM under load stops every process
in time, the engine's death gives 503s and exit 2, another API server's death stops the server."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvplug.interface import InvalidArgumentError
from tests.serve_process import STARTUP_TIMEOUT_S, free_port, get_json, start, stop
from tests.test_serve_engine_process import MAX_TOKENS, PROMPTS, _alive, _cmdline, _greedy_reference

SHUTDOWN_TIMEOUT_S = 5.0
EXIT_SLACK_S = 3.0
KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER = "x-kvplug-api-server"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from kvplug_transformers.embedded_model import ensure_embedded_model

    directory = tmp_path_factory.mktemp("kvplug-cache")
    ensure_embedded_model(directory)
    return directory


def _serve(cache_dir: Path, log: Path, *extra: str) -> tuple[object, int]:
    port = free_port()
    process = start(
        ["-m", "kvplug", "serve", "--api-server-count", "2", "--port", str(port), "--kv-memory", "16MiB",
         "--max-seq-len", "2048", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--api-key", KEY, *extra],
        cache_dir, log,
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:  # /health says ok only once every API server serves
        if process.poll() is not None:
            pytest.fail(f"kvplug serve exited with {process.returncode} before serving:\n{log.read_text()[-4000:]}")
        try:
            if get_json(port, "/health", timeout=5)[0] == 200:
                return process, port
        except OSError:
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail(f"kvplug serve did not answer within {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def _children(server_pid: int, log: Path) -> tuple[int, int]:
    """(the engine's pid, the other API server's pid): the server's Python children."""
    deadline = time.monotonic() + 10  # logged just after /health says ok
    while "this one and pids " not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    other = int(log.read_text().split("this one and pids ", 1)[1].split(")", 1)[0])
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    spawned = [int(pid) for pid in children if "spawn_main" in _cmdline(int(pid))]
    assert other in spawned and len(spawned) == 2, (children, [_cmdline(int(pid)) for pid in children])
    # named for ps / top and for kvplug bench serve, which counts its CPU on the HTTP side
    assert Path(f"/proc/{other}/comm").read_text().strip() == "kvplug-api-1"
    return next(pid for pid in spawned if pid != other), other


def _request(port: int, path: str, body: dict | None = None, headers: dict | None = AUTH,
             timeout: float = 60) -> tuple[int, str, bytes]:
    """(status, the answering API server, the body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers.get(HEADER), response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get(HEADER), error.read()


def _streamed(port: int, prompt: str) -> tuple[str, str | None, int | None, str]:
    """A streamed chat answer: (text, finish_reason, completion tokens, the answering API server)."""
    body = {"model": "kvplug-default", "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "stream": True, "stream_options": {"include_usage": True}}
    status, server, raw = _request(port, "/v1/chat/completions", body)
    assert status == 200, raw
    text, finish, tokens = [], None, None
    for line in raw.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[len("data: "):])
        for choice in chunk.get("choices") or ():
            text.append(choice["delta"].get("content") or "")
            finish = choice.get("finish_reason") or finish
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return "".join(text), finish, tokens, server


def test_two_api_servers_stream_the_greedy_answer_and_share_the_requests(cache_dir, tmp_path):
    log = tmp_path / "serve.log"
    process, port = _serve(cache_dir, log)
    try:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
        with ThreadPoolExecutor(12) as pool:  # concurrent: both API servers take some, the engine batches them
            streams = list(pool.map(lambda prompt: _streamed(port, prompt), prompts))
        servers = {server for *_, server in streams}
        for _ in range(5):  # the kernel hands connections out; a round of 12 gave both every time so far
            if servers == {"0", "1"}:
                break
            with ThreadPoolExecutor(12) as pool:
                servers |= {server for *_, server in pool.map(lambda prompt: _streamed(port, prompt), prompts)}
        assert servers == {"0", "1"}, servers
        # the guards answer in whichever API server took the connection
        refusals = {}
        for _ in range(40):
            status, server, _ = _request(port, "/v1/models", headers=None)
            assert status == 401
            refusals.setdefault(server, status)
            status, server, body = _request(port, "/v1/chat/completions", {
                "model": "kvplug-default", "max_tokens": -1, "messages": [{"role": "user", "content": "x"}]})
            assert status == 400 and b"max_tokens" in body, body
            refusals.setdefault(server, status)
            status, server, body = _request(port, "/v1/models")
            assert status == 200 and b"kvplug-default" in body
            status, server, body = _request(port, "/kvplug/stats")
            assert status == 200 and json.loads(body)["worker"]["alive"]
            status, server, body = _request(port, "/health", headers=None)
            assert status == 200
            if set(refusals) == {"0", "1"}:
                break
        assert set(refusals) == {"0", "1"}, refusals
        # one client id on concurrent requests (echoed only), and one seeded sampling, on whichever API server
        def seeded(_: int) -> tuple[int, str, dict]:
            headers = {**AUTH, "X-Request-ID": "same-id"}
            body = {"model": "kvplug-default", "prompt": "seeded", "max_tokens": 8, "temperature": 0.9, "seed": 7}
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json", **headers})
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.headers.get("x-request-id"), json.load(response)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(seeded, range(8)))
        assert {(status, echoed) for status, echoed, _ in answers} == {(200, "same-id")}
        assert len({reply["choices"][0]["text"] for *_, reply in answers}) == 1, answers
        status, _, body = _request(port, "/metrics")
        assert status == 200 and b"vllm:prefix_cache_queries_total" in body, body[:400]
        stats = json.loads(_request(port, "/kvplug/stats")[2])
        assert stats["finished_requests"] >= len(prompts) + 8  # the engine's counters, whichever API server asks
    finally:
        code, _ = stop(process)
    assert code == 0, log.read_text()[-4000:]
    for prompt, (text, finish, tokens, _) in zip(prompts, streams):
        reference = _greedy_reference(cache_dir, prompt)
        # the stream holds back the bytes of a UTF-8 sequence the last token left incomplete
        assert reference.startswith(text) and set(reference[len(text):]) <= {"\ufffd"}, prompt
        assert tokens is not None and finish == ("length" if tokens == MAX_TOKENS else "stop")


def test_sigterm_under_load_stops_every_process_in_time(cache_dir, tmp_path):
    log = tmp_path / "serve.log"
    process, port = _serve(cache_dir, log)
    engine, other = _children(process.pid, log)

    def request(i: int) -> tuple[int, bytes]:
        try:
            status, _, body = _request(port, "/v1/completions", {"model": "kvplug-default", "prompt": f"request {i}",
                                                                 "max_tokens": 5_000, "stream": True})
            return status, body
        except Exception as error:  # the test judges what each client saw
            return -1, str(error).encode()

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(request, i) for i in range(8)]
        time.sleep(3.0)
        code, seconds = stop(process, timeout=SHUTDOWN_TIMEOUT_S + EXIT_SLACK_S)
        outcomes = [future.result(timeout=30) for future in futures]
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert seconds <= SHUTDOWN_TIMEOUT_S + EXIT_SLACK_S
    deadline = time.monotonic() + 1.0
    while (_alive(engine) or _alive(other)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(engine) and not _alive(other), output[-4000:]
    for status, body in outcomes:  # each ended: finished, or cut off with a reason at the deadline
        assert status in (200, -1), (status, body)
    assert output.count("kvplug serve: stopped") == 2 and "Traceback" not in output, output[-4000:]


def test_engine_death_gives_503_on_both_and_exit_2(cache_dir, tmp_path):
    log = tmp_path / "serve.log"
    process, port = _serve(cache_dir, log)
    engine, other = _children(process.pid, log)
    os.kill(engine, signal.SIGKILL)
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 10
    while set(seen) != {"0", "1"} and time.monotonic() < deadline:
        try:
            status, server, body = _request(port, "/health", headers=None, timeout=2)
        except OSError:
            break  # the server is gone already
        if status == 503:
            seen[server] = json.loads(body)["reason"]
        time.sleep(0.02)
    code = process.wait(timeout=20)
    output = log.read_text()
    assert code == 2, output[-4000:]
    assert seen and all("engine process exited" in reason for reason in seen.values()), seen
    assert "the batching worker died" in output
    deadline = time.monotonic() + 2.0
    while _alive(other) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(other)


def test_another_api_server_dying_stops_the_server(cache_dir, tmp_path):
    log = tmp_path / "serve.log"
    process, port = _serve(cache_dir, log)
    engine, other = _children(process.pid, log)
    os.kill(other, signal.SIGKILL)
    code = process.wait(timeout=20)
    output = log.read_text()
    assert code == 2, output[-4000:]
    assert "API server 1 exited (exit code -9)" in output
    deadline = time.monotonic() + 2.0
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(engine)


def test_bad_counts_are_refused_with_the_rule():
    from kvplug_transformers.serve_options import ServeOptions

    for bad in (0, -1, 65, True, 1.5):
        with pytest.raises(InvalidArgumentError, match=r"--api-server-count must be an int in \[1, 64\]"):
            ServeOptions(api_server_count=bad, engine_process=True)
    with pytest.raises(InvalidArgumentError, match="needs the engine in its own process"):
        ServeOptions(api_server_count=2)
    assert ServeOptions().api_server_count == 1 and ServeOptions(api_server_count=2, engine_process=True)


def test_the_cli_implies_the_engine_process():
    from kvplug.cli import build_parser
    from kvplug.cli.serve import validate
    from kvplug.plugins import PluginManager

    manager = PluginManager(entry_points=False)
    options = validate(build_parser().parse_args(["serve", "--api-server-count", "3"]), manager)
    assert options["api_server_count"] == 3 and options["engine_process"] is True
    options = validate(build_parser().parse_args(["serve"]), manager)
    assert options["api_server_count"] == 1 and options["engine_process"] is False


def test_the_engine_keeps_two_api_servers_requests_apart():
    """Two API servers may name a request alike (a client's X-Request-ID is echoed, never used, but
    the engine must not rely on that): the engine's ids differ, each output goes back to its own
    API server under its own id, and an API server detached takes only its own requests."""
    import multiprocessing

    from kvplug_transformers import engine_protocol as protocol
    from kvplug_transformers.engine_links import FrontendLinks

    pipes = [multiprocessing.Pipe(duplex=True) for _ in range(2)]
    links = FrontendLinks([engine_end for _, engine_end in pipes])
    first, second = links.admit(0, "same"), links.admit(1, "same")
    assert first != second
    links.send_outputs([protocol.StepOutput(first, [1], False, None), protocol.StepOutput(second, [2], True, None)])
    assert pipes[0][0].recv() == (protocol.STEP, [protocol.StepOutput("same", [1], False, None)])
    assert pipes[1][0].recv() == (protocol.STEP, [protocol.StepOutput("same", [2], True, None)])
    links.send_outputs([protocol.StepOutput(second, [3], False, None)])  # finished before: dropped
    assert not pipes[1][0].poll(0.1)
    other = links.admit(1, "other")
    assert links.detach(1) == [other]
    assert links.detach(0 + 1) == [] and links.engine_id(0, "same") == first
    pipes[0][0].send((protocol.STATS, 7))
    assert list(links.receive()) == [(0, (protocol.STATS, 7))]
    single = FrontendLinks([pipes[0][1]])  # --engine-process alone: the ids as they come
    assert single.admit(0, "same") == "same"
