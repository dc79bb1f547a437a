"""A real SGLang server process for the tests: ``python -m sglang.launch_server --device cpu`` on
127.0.0.1, its log in a file, readiness polled over HTTP, stopped by SIGTERM with a bounded wait;
and a ZMQ subscriber for its KV events (``--kv-events-config``).

The server runs with ``tests/sglang_cpu_support`` on ``PYTHONPATH`` (a plain-torch stand-in for
the one GPU-stack module SGLang's CPU path imports; see its README).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

CPU_SUPPORT = Path(__file__).resolve().parent / "sglang_cpu_support"
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One SGLang server; ``start()`` returns once it answers ``/health`` (or raises with its log).
    ``python``: the interpreter of SGLang's environment (default: this one); ``start_timeout_s`` and
    ``stop_timeout_s``: how long a start and a stop may take (longer with several servers on a small
    machine)."""

    def __init__(
        self, model: Path, log: Path, *flags: str, python: str = sys.executable,
        start_timeout_s: float = START_TIMEOUT_S, stop_timeout_s: float = STOP_TIMEOUT_S,
    ) -> None:  # fmt: skip
        self.port = free_port()
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.model = model
        self.log = log
        self.command = [
            python, "-m", "sglang.launch_server",
            "--model-path", str(model), "--device", "cpu", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-total-tokens", "2048", "--max-running-requests", "8", "--random-seed", "1",
            *flags,
        ]  # fmt: skip
        self.process: Optional[subprocess.Popen] = None
        self.children: list[int] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Server":
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the process (several servers may start at once); ``wait_ready()`` then waits."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CPU_SUPPORT), env.get("PYTHONPATH")]))
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )

    def wait_ready(self) -> "Server":
        import requests

        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"SGLang server exited with {self.process.returncode} at startup:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.children = _children(self.process.pid)
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.kill()
        raise AssertionError(f"SGLang server not ready after {self.start_timeout_s:.0f} s:\n{self.log_tail()}")

    def generate(self, text: str, max_new_tokens: int = 8) -> dict:
        import requests

        body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        response = requests.post(f"{self.url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    def post(self, path: str) -> Any:
        import requests

        return requests.post(f"{self.url}{path}", timeout=60)

    def openai(self) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> int:
        """SIGTERM the server (the launcher process only, as a process manager would); returns its
        exit status. Raises when it or one of its processes outlives ``stop_timeout_s``."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            status = self.process.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"SGLang server ignored SIGTERM for {self.stop_timeout_s:.0f} s:\n{self.log_tail()}") from None
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline and any(_alive(pid) for pid in self.children):
            time.sleep(0.2)
        left = [pid for pid in self.children if _alive(pid)]
        if left:
            self.kill()
            raise AssertionError(f"SGLang processes {left} outlived the server's SIGTERM:\n{self.log_tail()}")
        return status

    def kill(self) -> None:
        """Last resort (a failed test): SIGKILL the server and the processes it started."""
        for pid in [*self.children, *( [self.process.pid] if self.process else [])]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.process is not None:
            self.process.wait(timeout=STOP_TIMEOUT_S)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as error:
            return f"(no log: {error})"


def _children(pid: int) -> list[int]:
    import psutil

    return [child.pid for child in psutil.Process(pid).children(recursive=True)]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class EventSubscriber:
    """Reads a server's KV events from its ZMQ publisher (``events_config()`` is the server flag)."""

    def __init__(self) -> None:
        import zmq

        self.port = free_port()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.LINGER, 0)

    def events_config(self) -> str:
        return json.dumps(
            {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.port}", "bind": True, "topic": "kv-events"}
        )

    def connect(self) -> None:
        self.socket.connect(f"tcp://127.0.0.1:{self.port}")
        time.sleep(1.0)  # ZMQ's slow joiner: let the subscription reach the publisher

    def drain(self, quiet_s: float = 3.0, limit_s: float = 60.0) -> list[Any]:
        """Every event published until ``quiet_s`` pass without one (SGLang's classes)."""
        import msgspec
        import zmq
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        events: list[Any] = []
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and self.socket.poll(int(quiet_s * 1000), zmq.POLLIN):
            topic, _sequence, payload = self.socket.recv_multipart()
            assert topic == b"kv-events"
            events += decoder.decode(payload).events
        return events

    def close(self) -> None:
        self.socket.close()
        self.context.term()
