"""Streams nobody reads cannot hold ``kvplug serve`` (issue 32, slow readers): a real server on
127.0.0.1 with a short ``--stream-stall-timeout``, raw sockets with a 4 KiB receive buffer that
send a streaming chat request and never read. Within a bound of the stall timeout every one of
them is cut off (the server closes the connection, its row is freed, no page is leaked), a normal
request meanwhile and afterwards answers, and SIGTERM exits 0.

The bounds are the stall timeout plus a margin for a loaded 2-core machine; they are not timings
of the server (the hang they catch lasted until SIGTERM)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from tests.serve_process import free_port, get_json, post, start, stop, wait_ready

STALL_TIMEOUT_S = 2.0
CUT_OFF_MARGIN_S = 30.0  # generation until the buffers fill, then the stall timeout, on a busy CPU
CLOSE_MARGIN_S = 10.0  # from the cut-off until every silent client sees its connection closed
MAX_TOKENS = 1200
# every streamed event carries the model's name: with a 2,000-character one a few dozen tokens fill
# a client's buffers, so the streams stall within seconds on a CPU (with the default name it takes
# ~1,300 tokens per stream, minutes with 12 streams on a 2-core machine)
MODEL_NAME = "silent-readers-" + "m" * 2000
TCP_ESTABLISHED = 1
HI = [{"role": "user", "content": "hi"}]


def _stream_request() -> bytes:
    data = json.dumps({"messages": HI, "stream": True, "max_tokens": MAX_TOKENS}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(data) + data)


def _silent_reader(port: int) -> socket.socket:
    """A client that sends its request and never reads (4 KiB receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(_stream_request())
    return sock


def _tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of a client socket (``tcpi_state``, the first byte of ``TCP_INFO``),
    read without reading the stream: a server that closed or reset the connection moved it out of
    ESTABLISHED; one that merely gave up on it, with its output still queued, did not."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def _stats(port: int) -> dict:
    status, stats = get_json(port, "/kvplug/stats")
    assert status == 200, stats
    return stats


def _timed_request(port: int) -> float:
    started = time.monotonic()
    status, reply = post(port, "/v1/chat/completions",
                         json.dumps({"messages": [{"role": "user", "content": "ok?"}], "max_tokens": 3}).encode(),
                         timeout=60)
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply
    return time.monotonic() - started


def _run_silent_readers(tmp_path, streams: int) -> dict:
    if not hasattr(socket, "TCP_INFO"):
        pytest.skip("reads a socket's TCP state with TCP_INFO (Linux)")
    from kvplug_transformers.embedded_model import ensure_embedded_model

    ensure_embedded_model(tmp_path / "cache")
    port, log = free_port(), tmp_path / "serve.log"
    process = start(["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "64MiB",
                     "--max-running-reqs", str(streams + 8), "--stream-stall-timeout", str(STALL_TIMEOUT_S),
                     "--served-model-name", MODEL_NAME, "--log-level", "warning"], tmp_path / "cache", log)
    readers: list[socket.socket] = []
    try:
        wait_ready(process, port, log)
        before = _stats(port)["connections"]["stalled_streams"]
        opened = time.monotonic()
        readers = [_silent_reader(port) for _ in range(streams)]
        deadline = opened + STALL_TIMEOUT_S + CUT_OFF_MARGIN_S
        while _stats(port)["running_requests"] < 1:  # the streams are generating
            assert time.monotonic() < deadline, _stats(port)
            time.sleep(0.1)
        latency_during = _timed_request(port)
        while True:
            stats = _stats(port)
            if stats["in_flight"] == 0 and stats["running_requests"] == 0:
                break
            assert time.monotonic() < deadline, (
                f"{stats['in_flight']} requests still in flight, {stats['running_requests']} running "
                f"{time.monotonic() - opened:.1f} s after {streams} silent streams opened "
                f"(--stream-stall-timeout {STALL_TIMEOUT_S:g}): {stats}")
            time.sleep(0.2)
        cut_off_s = time.monotonic() - opened
        stalled = stats["connections"]["stalled_streams"] - before
        assert stalled == streams, f"{stalled} of {streams} silent streams counted as stalled: {stats}"
        close_deadline = time.monotonic() + CLOSE_MARGIN_S
        while (still_open := [sock for sock in readers if _tcp_state(sock) == TCP_ESTABLISHED]):
            assert time.monotonic() < close_deadline, (
                f"the server left {len(still_open)} of {streams} stalled connections open "
                f"{time.monotonic() - opened:.1f} s after they were opened (their output still queued)")
            time.sleep(0.2)
        closed_s = time.monotonic() - opened
        latency_after = _timed_request(port)
        while True:  # pages back: none held at idle but the prefix cache's
            stats = _stats(port)
            if stats["used_pages"] == stats["cached_pages"]:
                break
            assert time.monotonic() < deadline + 30, f"pages still held at idle: {stats}"
            time.sleep(0.2)
        assert stats["worker"] == {"alive": True, "error": None}
    finally:
        code, stop_s = stop(process)  # the silent clients still hold their sockets
        for sock in readers:
            sock.close()
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    return {"cut_off_s": cut_off_s, "closed_s": closed_s, "latency_during_s": latency_during, "latency_after_s": latency_after,
            "stop_s": stop_s}


def test_silent_streams_are_cut_off_and_the_server_keeps_answering(tmp_path):
    result = _run_silent_readers(tmp_path, streams=12)
    print(f"12 silent streams: {result}")


@pytest.mark.slow
def test_forty_silent_streams_are_cut_off_and_the_server_keeps_answering(tmp_path):
    result = _run_silent_readers(tmp_path, streams=40)
    print(f"40 silent streams: {result}")


# ---- trickling readers: every send makes progress, the stream still falls behind
# A trickling client takes TRICKLE_BYTES every TRICKLE_INTERVAL_S: fast enough that each single send
# waits under the stall timeout (the limit was once per send: such a client held its row until a
# send happened to wait too long), far slower than the stream is produced. Its full buffer must
# drain completely within the stall timeout, so it is cut off within a bound. A steady client reads all that has arrived every
# STEADY_INTERVAL_S: it keeps up with the token rate and must get its whole stream.
# The server joins a stream's waiting text into one event when it is behind (coalesced_stream), so a
# reader falls behind only when it drains less than the write buffer within the stall timeout, whatever
# the token rate: 512 B every 0.25 s drains 16 KiB in 8 s, past the 5 s stall timeout.
TRICKLE_BYTES = 512
TRICKLE_INTERVAL_S = 0.25
STEADY_INTERVAL_S = 0.1
STEADY_MAX_TOKENS = 150
# each single send of a trickling stream waits ~1 s for the buffers to drain (the kernel wakes the
# writer only once a good part of its buffer is free): under this stall timeout, so a per-send limit
# cuts such a stream off only by chance (TCP's window probing with tiny buffers), late if at all
TRICKLE_STALL_TIMEOUT_S = 5.0
TRICKLE_CUT_OFF_MARGIN_S = 10.0  # the buffers fill within a few seconds at ~3x the read rate, then the deadline
TRICKLE_RCVBUF = 4096
# ~5 KB per event: a stream is produced at ~125 KB/s on a 2-core CPU, three times what a trickler reads
TRICKLE_MODEL_NAME = "trickling-readers-" + "m" * 8000
STREAM_END = b"\r\n0\r\n\r\n"  # the chunked body's last chunk: the stream ended in full


def _chunked_reader(port: int, rcvbuf: int | None, chunk: int, interval: float, max_tokens: int,
                    done: threading.Event, seen: list) -> threading.Thread:
    """A client thread that sends a streaming request, then reads at most ``chunk`` bytes every
    ``interval`` s until the server closes the connection (or ``done``); ``seen`` gets what it read."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps({"messages": HI, "stream": True, "max_tokens": max_tokens}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                 b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
    sock.setblocking(False)

    def read() -> None:
        try:
            while not done.is_set():
                try:
                    got = sock.recv(chunk)
                except BlockingIOError:
                    got = None
                except OSError:
                    break  # reset by the server
                if got == b"":
                    break
                if got:
                    seen.append(got)
                time.sleep(interval)
        finally:
            sock.close()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_trickling_streams_are_cut_off_and_steady_ones_are_not(tmp_path):
    from kvplug_transformers.embedded_model import ensure_embedded_model

    trickling, steady = 6, 2
    ensure_embedded_model(tmp_path / "cache")
    port, log = free_port(), tmp_path / "serve.log"
    process = start(["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "64MiB",
                     "--max-running-reqs", str(trickling + steady + 8), "--stream-stall-timeout", str(TRICKLE_STALL_TIMEOUT_S),
                     "--served-model-name", TRICKLE_MODEL_NAME, "--log-level", "warning"], tmp_path / "cache", log)
    done = threading.Event()
    threads: list[threading.Thread] = []
    try:
        wait_ready(process, port, log)
        before = _stats(port)["connections"]["stalled_streams"]
        opened = time.monotonic()
        trickled: list[list] = [[] for _ in range(trickling)]
        steadied: list[list] = [[] for _ in range(steady)]
        trickle_threads = [_chunked_reader(port, TRICKLE_RCVBUF, TRICKLE_BYTES, TRICKLE_INTERVAL_S, MAX_TOKENS, done, seen)
                           for seen in trickled]
        steady_threads = [_chunked_reader(port, None, 1 << 20, STEADY_INTERVAL_S, STEADY_MAX_TOKENS, done, seen)
                          for seen in steadied]
        threads = trickle_threads + steady_threads
        deadline = opened + TRICKLE_STALL_TIMEOUT_S + CUT_OFF_MARGIN_S
        while _stats(port)["running_requests"] < 1:
            assert time.monotonic() < deadline, _stats(port)
            time.sleep(0.1)
        latency_during = _timed_request(port)
        while True:
            stats = _stats(port)
            if stats["in_flight"] == 0 and stats["running_requests"] == 0:
                break
            assert time.monotonic() < deadline, (
                f"{stats['in_flight']} requests still in flight, {stats['running_requests']} running "
                f"{time.monotonic() - opened:.1f} s after {trickling} trickling streams opened (each reading "
                f"{TRICKLE_BYTES} B every {TRICKLE_INTERVAL_S:g} s; --stream-stall-timeout {TRICKLE_STALL_TIMEOUT_S:g}): "
                f"{[sum(map(len, seen)) for seen in trickled]} bytes read: {stats}")
            time.sleep(0.2)
        cut_off_s = time.monotonic() - opened
        assert cut_off_s < TRICKLE_STALL_TIMEOUT_S + TRICKLE_CUT_OFF_MARGIN_S, (
            f"the trickling streams held the server for {cut_off_s:.1f} s (--stream-stall-timeout "
            f"{TRICKLE_STALL_TIMEOUT_S:g}): {stats}")
        for thread in threads:
            thread.join(CLOSE_MARGIN_S)
            assert not thread.is_alive(), "the server left a connection open after its stream ended"
        for seen in steadied:
            body = b"".join(seen)
            assert body.startswith(b"HTTP/1.1 200") and body.endswith(STREAM_END), (
                f"a steady reader did not get its whole stream ({len(body)} bytes): ...{body[-300:]!r}")
            assert b'"error"' not in body, body[-2000:]
        stalled = stats["connections"]["stalled_streams"] - before
        assert stalled == trickling, f"{stalled} streams cut off, expected the {trickling} trickling ones: {stats}"
        behind = stats["connections"].get("backlog_timeouts", 0)
        assert behind == trickling, (
            f"{behind} of {trickling} trickling streams cut off for a backlog that did not drain in time: {stats}")
        for seen in trickled:
            assert not b"".join(seen).endswith(STREAM_END), "a trickling stream was answered in full"
        latency_after = _timed_request(port)
        while True:
            stats = _stats(port)
            if stats["used_pages"] == stats["cached_pages"]:
                break
            assert time.monotonic() < deadline + 30, f"pages still held at idle: {stats}"
            time.sleep(0.2)
        assert stats["worker"] == {"alive": True, "error": None}
    finally:
        done.set()
        code, stop_s = stop(process)
        for thread in threads:
            thread.join(5)
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    print(f"{trickling} trickling + {steady} steady streams: cut off {cut_off_s:.1f} s, latency during "
          f"{latency_during:.2f} s, after {latency_after:.2f} s, SIGTERM {stop_s:.1f} s")
