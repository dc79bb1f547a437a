"""``benchmarks/fleet.py``'s client side (issue 27): the first token it reports to Dynamo and the
router settings it passes on, against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import http.server
import importlib.util
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

SPEC = importlib.util.spec_from_file_location("fleet_bench", Path(__file__).resolve().parents[1] / "benchmarks/fleet.py")
fleet = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(fleet)


def chunk(delta: dict, finish: str | None = None) -> bytes:
    choice = {"delta": delta, "index": 0, **({"finish_reason": finish} if finish else {})}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


def serve(chunks: list[bytes], hold: threading.Event | None = None):
    """A server streaming ``chunks`` (then ``[DONE]``) to one POST, waiting for ``hold`` after the
    first; returns the server."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for number, part in enumerate(chunks):
                self.wfile.write(part)
                self.wfile.flush()
                if number == 0 and hold is not None:
                    hold.wait(10)
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.handle_request, daemon=True).start()
    return server


@pytest.mark.parametrize("first_text", ["", "A"])
def test_first_token_is_the_first_token_chunk_not_the_role_chunk(first_text: str) -> None:
    parts = [chunk({"role": "assistant"}), chunk({"content": first_text}), chunk({"content": "bc"}),
             chunk({}, finish="length")]
    hold = threading.Event()  # the role chunk is out; the token chunks wait for it
    server = serve(parts, hold)
    timer = threading.Timer(0.5, hold.set)
    timer.start()
    worker = SimpleNamespace(port=server.server_address[1], id=1)
    calls = []
    text, ttft, total = fleet.streamed_chat(worker, [{"role": "user", "content": "hi"}], 4,
                                            lambda: calls.append(hold.is_set()))
    timer.join()
    server.server_close()
    assert calls == [True], "called once, for a token chunk, not for the role chunk sent before"
    assert text == first_text + "bc"
    assert 0 <= ttft <= total


def test_a_reply_of_no_text_still_has_a_first_token() -> None:
    server = serve([chunk({"role": "assistant"}), chunk({}, finish="length")])
    worker = SimpleNamespace(port=server.server_address[1], id=1)
    calls = []
    text, _, _ = fleet.streamed_chat(worker, [], 1, lambda: calls.append(1))
    server.server_close()
    assert (text, calls) == ("", [1])


def test_router_env_takes_dynamo_variables_only() -> None:
    assert fleet.router_env(["DYN_ROUTER_PREFILL_LOAD_SCALE=4", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT=2"]) == {
        "DYN_ROUTER_PREFILL_LOAD_SCALE": "4", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "2"}
    for bad in ("PATH=/tmp", "DYN_ROUTER_TEMPERATURE"):
        with pytest.raises(SystemExit):
            fleet.router_env([bad])
