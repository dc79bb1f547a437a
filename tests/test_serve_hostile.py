"""``kvplug serve`` against hostile clients (issue 33; issue 32 item 6): one real server on
127.0.0.1 (embedded model, an API key, short read deadlines, a small connection cap), raw sockets
and plain HTTP. Each attack asserts the answer, then that the server still serves with no page
held at idle (``/kvplug/stats``). Client counts and times are bounded."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve_process import free_port, get_json, post, start, stop, wait_ready

API_KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HEAD_TIMEOUT_S = 2
BODY_TIMEOUT_S = 3
STALL_TIMEOUT_S = 3
MAX_CONNECTIONS = 40
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from kvplug_transformers.embedded_model import ensure_embedded_model

    cache_dir = tmp_path_factory.mktemp("kvplug-cache")
    ensure_embedded_model(cache_dir)
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    process = start(
        ["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "64MiB", "--api-key", API_KEY,
         "--timeout-header", str(HEAD_TIMEOUT_S), "--timeout-body", str(BODY_TIMEOUT_S),
         "--stream-stall-timeout", str(STALL_TIMEOUT_S), "--limit-concurrency", str(MAX_CONNECTIONS),
         "--log-level", "warning"],
        cache_dir, log,
    )
    wait_ready(process, port, log, api_key=API_KEY)
    yield port, process, log, cache_dir
    code, _ = stop(process)
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert len(output) < 1 << 20, "the log grew past 1 MiB"


def _post(port: int, path: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return post(port, path, data, {**AUTH, **(headers or {})})


def _stats(port: int) -> dict:
    status, stats = get_json(port, "/kvplug/stats", headers=AUTH)
    assert status == 200, stats
    return stats


def _assert_serving_and_idle(port: int) -> None:
    """A normal request works, the worker lives, and once idle no page is held but cached ones."""
    status, reply = _post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ok?"}],
                                                         "max_tokens": 3})
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply
    assert get_json(port, "/health") == (200, {"status": "ok"})
    deadline = time.monotonic() + 30
    while True:
        stats = _stats(port)
        idle = stats["in_flight"] == 0 and stats["running_requests"] == 0
        if idle and stats["used_pages"] == stats["cached_pages"]:
            break
        assert time.monotonic() < deadline, f"pages still held at idle: {stats}"
        time.sleep(0.2)
    assert stats["worker"] == {"alive": True, "error": None}


def _raw(port: int, data: bytes, timeout: float = 20, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    if data:
        sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    except (ConnectionResetError, TimeoutError):
        pass
    return b"".join(chunks)


def _stream_request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + API_KEY.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(data) + data
    )


# ------------------------------------------------------------------ 1: request ids
def test_a_reused_x_request_id_collides_with_nothing(server):
    port = server[0]
    same = {"X-Request-ID": "same-id-123"}
    calls = [
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 4, "stream": True}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
    ] * 2

    def call(path_body):
        path, body = path_body
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", **AUTH, **same},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("x-request-id"), response.read()

    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(call, calls))
    assert [status for status, _, _ in answers] == [200] * len(calls)
    assert all(echoed == "same-id-123" for _, echoed, _ in answers)  # echoed, never used as the id
    ids = [json.loads(text)["id"] for (_, _, text), (_path, body) in zip(answers, calls, strict=True) if not body.get("stream")]
    assert len(set(ids)) == len(ids) and not any("same-id-123" in i for i in ids)
    # a client that disconnects mid-request, then the same id again: answered, nothing stuck
    sock = _raw(port, _stream_request({"messages": HI, "max_tokens": 200, "stream": True}).replace(
        b"Host: x\r\n", b"Host: x\r\nX-Request-ID: same-id-123\r\n"))
    sock.recv(100)
    sock.close()
    assert _post(port, "/v1/chat/completions", {"messages": HI, "max_tokens": 3}, same)[0] == 200
    _assert_serving_and_idle(port)


# ------------------------------------------------------------------ 2: templates and kwargs
@pytest.mark.parametrize("kwargs", [
    {"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"},
    {"chat_template": "{{ 'x' * 30000000 }}"},
    {"add_generation_prompt": False}, {"tokenize": False}, {"return_tensors": "np"}, {"return_dict": False},
    {"tools": []}, {"continue_final_message": True}, {"enable_thinking": "yes"},
])
def test_client_templates_and_call_arguments_are_refused(server, kwargs):
    port = server[0]
    for path, body in (("/v1/chat/completions", {"messages": HI}), ("/v1/responses", {"input": "hi"})):
        status, answer = _post(port, path, {**body, "chat_template_kwargs": kwargs})
        assert status == 400, answer
        assert answer["error"]["param"] == "chat_template_kwargs" and next(iter(kwargs)) in answer["error"]["message"]


def test_allowed_template_kwargs_are_served(server):
    port = server[0]
    status, answer = _post(port, "/v1/chat/completions", {"messages": HI, "max_tokens": 2,
                                                          "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200, answer


# ------------------------------------------------------------------ 4 and 5: client errors are 4xx
DEEP = '{"a": ' * 900 + "1" + "}" * 900  # a JSON object nested 900 deep, as a string
CHAT_400 = [
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages", "surrogate"),
    ({"model": "\udfff", "messages": HI}, "model", "surrogate"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not"}}]}]},
     "messages[1]", "must be a JSON object"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": DEEP}}]}]},
     "messages[1]", "nests deeper"),
    ({"messages": HI, "generation_config": '{"eos_token_id": "abc"}'}, "generation_config", "eos_token_id"),
    ({"messages": HI, "generation_config": '{"eos_token_id": [1, "a"]}'}, "generation_config", "eos_token_id"),
    ({"messages": HI, "generation_config": '{"eos_token_id": 1.5}'}, "generation_config", "eos_token_id"),
    *[({"messages": HI, "generation_config": json.dumps({field: value})}, "generation_config", field)
      for field, value in (("suppress_tokens", [1]), ("bad_words_ids", [[1]]), ("begin_suppress_tokens", [1]),
                           ("forced_bos_token_id", 1), ("min_new_tokens", 2), ("max_time", 1.0))],
    ({"messages": HI, "n": True}, "n", "n must be 1"),
]
RESPONSES_400 = [
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "nope"}]}, "input",
     "must be a JSON object"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text", "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text", "text.format"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "tool_choice"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "conversation"),
    ({"input": "hi", "prompt": {"id": "p"}}, "prompt", "prompt"),
    ({"input": "\ud83d"}, "input", "surrogate"),
]


@pytest.mark.parametrize("body, param, words", CHAT_400)
def test_bad_chat_fields_get_a_400_naming_them(server, body, param, words):
    status, answer = _post(server[0], "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer


@pytest.mark.parametrize("body, param, words", RESPONSES_400)
def test_bad_responses_fields_get_a_400_naming_them(server, body, param, words):
    status, answer = _post(server[0], "/v1/responses", json.dumps(body).encode())
    assert status == 400, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer


def test_deep_bodies_and_openapi(server):
    port = server[0]
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, answer = _post(port, "/v1/chat/completions", deep)
    assert status == 400 and "nests deeper" in answer["error"]["message"], answer
    status, schema = get_json(port, "/openapi.json", headers=AUTH)
    assert status == 200 and "/v1/responses" in schema["paths"]
    _assert_serving_and_idle(port)


# ------------------------------------------------------------------ 6: exposure
def test_every_route_but_health_needs_the_key_and_models_show_no_paths(server):
    port, _, _, cache_dir = server
    for path in ("/docs", "/redoc", "/openapi.json", "/kvplug/stats", "/metrics", "/v1/models"):
        status, answer = get_json(port, path)
        assert status == 401 and "--api-key" in answer["error"]["message"], path
    assert get_json(port, "/health")[0] == 200
    for path in ("/flush_cache", "/reset_prefix_cache"):  # issue 27: emptying the cache needs the key too
        status, answer = post(port, path, b"{}")
        assert status == 401 and "--api-key" in answer["error"]["message"], path
    status, models = get_json(port, "/v1/models", headers=AUTH)
    assert status == 200 and str(cache_dir) not in json.dumps(models) and "/" not in json.dumps(models["data"])


# ------------------------------------------------------------------ 2: the event loop stays free
def test_health_stays_fast_while_hostile_requests_run(server):
    """Long prompts, bodies near the size limit and deep nesting are parsed and tokenised off the
    event loop: ``/health`` keeps answering meanwhile."""
    port = server[0]
    near_limit = {"messages": [{"role": "user", "content": "x" * 100_000}]}  # tokenised, then refused by length
    huge = {"messages": [{"role": "user", "content": "y" * 3_900_000}]}  # refused on its bytes
    deep = b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    bodies = [json.dumps(near_limit).encode(), json.dumps(huge).encode(), deep] * 8
    stop_probe = threading.Event()
    latencies: list[float] = []

    def probe() -> None:
        while not stop_probe.is_set():
            start_time = time.monotonic()
            assert get_json(port, "/health", timeout=30)[0] == 200
            latencies.append(time.monotonic() - start_time)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            statuses = [status for status, _ in pool.map(lambda b: _post(port, "/v1/chat/completions", b), bodies)]
    finally:
        stop_probe.set()
        prober.join()
    assert set(statuses) == {400}, statuses
    assert len(latencies) >= 5
    print(f"/health under hostile requests: {len(latencies)} probes, median {sorted(latencies)[len(latencies) // 2]:.4f} s, "
          f"max {max(latencies):.4f} s")
    # generous for a shared CI machine: before, one 3.9 MB prompt held every route for 9 s
    assert max(latencies) < 1.5, sorted(latencies)[-5:]
    _assert_serving_and_idle(port)


# ------------------------------------------------------------------ 3: connections
def test_half_sent_heads_and_slow_bodies_get_408(server):
    port = server[0]
    start_time = time.monotonic()
    head = _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n")
    body = _raw(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nauthorization: Bearer " + API_KEY.encode()
                + b"\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n1\r\n{\r\n")

    def trickle() -> None:  # one byte a second, never finishing
        for _ in range(BODY_TIMEOUT_S + 3):
            time.sleep(1)
            try:
                body.sendall(b"1\r\n \r\n")
            except OSError:
                return

    threading.Thread(target=trickle, daemon=True).start()
    idle = _raw(port, b"")
    head_answer, body_answer, idle_answer = _read_all(head), _read_all(body), _read_all(idle)
    assert head_answer.startswith(b"HTTP/1.1 408") and b"--timeout-header" in head_answer, head_answer
    assert body_answer.startswith(b"HTTP/1.1 408") and b"--timeout-body" in body_answer, body_answer
    assert idle_answer.startswith(b"HTTP/1.1 408"), idle_answer
    assert time.monotonic() - start_time < BODY_TIMEOUT_S + 10
    for sock in (head, body, idle):
        sock.close()
    _assert_serving_and_idle(port)


def test_at_the_connection_cap_idle_connections_make_room_and_busy_ones_get_a_503(server):
    port = server[0]
    held = [_raw(port, b"GET /health HTTP/1.1\r\n") for _ in range(MAX_CONNECTIONS)]  # heads never finished
    time.sleep(0.3)
    for _ in range(3):  # real requests still get through: the longest-idle connection gives way
        sock = _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_all(sock).startswith(b"HTTP/1.1 200"), "a normal request was not served at the cap"
        sock.close()
    answers = [_read_all(sock) for sock in held]
    for sock in held:
        sock.close()
    made_room = [a for a in answers if b"sent no request" in a]
    assert len(made_room) >= 1 and all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[:3]
    # every connection carrying a request (bodies still arriving): one more is refused at once
    busy_head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nauthorization: Bearer " + API_KEY.encode()
                 + b"\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{")
    busy = [_raw(port, busy_head) for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.5)
    extra = _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", timeout=5)
    answer = _read_all(extra)
    assert answer.startswith(b"HTTP/1.1 503") and b"--limit-concurrency" in answer, answer
    extra.close()
    for sock in busy:  # then the body deadline frees them
        assert _read_all(sock).startswith(b"HTTP/1.1 408")
        sock.close()
    connections = _stats(port)["connections"]
    assert connections["refused_connections"] >= 1 and connections["closed_for_room"] >= 1, connections
    _assert_serving_and_idle(port)


# ------------------------------------------------------------------ slow readers (issue 32 item 6)
def test_streams_nobody_reads_are_cut_off_and_their_rows_freed(server):
    port = server[0]
    before = _stats(port)["connections"]["stalled_streams"]
    readers = [
        _raw(port, _stream_request({"messages": HI, "stream": True, "max_tokens": 3000}), rcvbuf=4096)
        for _ in range(3)
    ]
    start_time = time.monotonic()
    status, reply = _post(port, "/v1/chat/completions", {"messages": HI, "max_tokens": 3})
    assert status == 200, reply
    deadline = time.monotonic() + 90
    while _stats(port)["connections"]["stalled_streams"] < before + len(readers):
        assert time.monotonic() < deadline, _stats(port)
        time.sleep(0.5)
    elapsed = time.monotonic() - start_time
    for sock in readers:
        sock.close()
    _assert_serving_and_idle(port)
    assert elapsed < 90


def test_idle_sockets_past_the_descriptor_limit_neither_block_requests_nor_flood_the_log(tmp_path):
    """``ulimit -n 400`` and 420 idle sockets (the connection cap follows the limit): a normal
    request is served, nothing logs "Too many open files", the log stays small."""
    import resource

    from kvplug_transformers.embedded_model import ensure_embedded_model

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1000 and hard < 1000:
        pytest.skip("this test's own 420 sockets need ulimit -n >= 1000")
    if soft < 1000:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    ensure_embedded_model(tmp_path / "cache")
    port, log = free_port(), tmp_path / "serve.log"
    process = start(["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "16MiB", "--max-seq-len", "512", "--log-level", "warning"],
                    tmp_path / "cache", log, max_open_files=400)
    try:
        wait_ready(process, port, log)
        idle = []
        for _ in range(420):
            try:
                idle.append(_raw(port, b"", timeout=5))
            except OSError:
                break
        time.sleep(1.0)
        sock = _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=10)
        assert _read_all(sock).startswith(b"HTTP/1.1 200")
        sock.close()
        status, reply = post(port, "/v1/chat/completions",
                             json.dumps({"messages": HI, "max_tokens": 2}).encode(), timeout=30)
        assert status == 200, reply
        for sock in idle:
            sock.close()
    finally:
        code, _ = stop(process)
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert "Too many open files" not in output and "Traceback" not in output, output[-3000:]
    assert len(output) < 256 << 10
