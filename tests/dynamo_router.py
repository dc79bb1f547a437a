"""NVIDIA Dynamo's KV router for the fleet tests (issue 27): its standalone indexer and selection
service (``ai-dynamo-runtime==1.6.1`` in an environment of its own, ``KVPLUG_DYNAMO_PYTHON``; built by
``bash scripts/test-dynamo-fleet.sh``) on 127.0.0.1, fed by every worker's KV events."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

DYNAMO_VERSION = "1.6.1"
SETTLE_S = 20.0  # how long a score may take to follow the events


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def dynamo_python() -> str:
    python = os.environ.get("KVPLUG_DYNAMO_PYTHON")
    if not python:
        pytest.skip("set KVPLUG_DYNAMO_PYTHON to a Python with ai-dynamo-runtime==1.6.1 "
                    "(bash scripts/test-dynamo-fleet.sh builds one and runs this test)")
    found = subprocess.run([python, "-c", "import importlib.metadata as m, dynamo.llm; "
                            "print(m.version('ai-dynamo-runtime'))"], capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, f"KVPLUG_DYNAMO_PYTHON={python} cannot import dynamo: {found.stderr[-2000:]}"
    assert found.stdout.strip() == DYNAMO_VERSION, f"ai-dynamo-runtime {found.stdout.strip()}, expected {DYNAMO_VERSION}"
    return python


def call(url: str, body: dict | None = None, method: str | None = None, timeout: float = 60) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method or ("GET" if data is None else "POST"),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, _json(response.read())
    except urllib.error.HTTPError as error:
        return error.code, _json(error.read())


def _json(raw: bytes) -> dict:
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {"raw": raw.decode(errors="replace")}  # Dynamo's /health answers plain text


class Dynamo:
    """Dynamo's indexer and selection service, both fed by every worker's events."""

    def __init__(self, python: str, logs: Path, model: str, page: int) -> None:
        self.model, self.page = model, page
        self.indexer_port, self.select_port = free_port(), free_port()
        self.processes = []
        for module, port in (("dynamo.indexer", self.indexer_port), ("dynamo.select_service", self.select_port)):
            log = open(logs / f"{module}.log", "wb")
            self.processes.append(subprocess.Popen([python, "-m", module, "--port", str(port), "--threads", "1"],
                                                   stdout=log, stderr=subprocess.STDOUT))
            log.close()

    def wait_ready(self) -> None:
        for port in (self.indexer_port, self.select_port):
            deadline = time.monotonic() + 60
            while True:
                try:
                    if call(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                        break
                except (urllib.error.URLError, ConnectionError, OSError):
                    pass
                assert time.monotonic() < deadline, f"Dynamo did not answer on port {port}"
                time.sleep(0.2)

    def register(self, worker) -> None:
        """``worker``: ``worker_id``, ``url``, ``events_port``, ``replay_port`` (its ZMQ publisher)."""
        events, replay = f"tcp://127.0.0.1:{worker.events_port}", f"tcp://127.0.0.1:{worker.replay_port}"
        status, body = call(f"http://127.0.0.1:{self.indexer_port}/register", {
            "instance_id": worker.worker_id, "endpoint": events, "replay_endpoint": replay, "block_size": self.page,
            "model_name": self.model})
        assert status in (200, 201) and body["status"] == "ok", body
        status, body = call(f"http://127.0.0.1:{self.select_port}/workers", {
            "worker_id": worker.worker_id, "endpoint": worker.url, "kv_events_endpoints": {"0": events},
            "replay_endpoint": replay, "block_size": self.page, "model_name": self.model})
        assert status in (200, 201) and body["lifecycle"] == "schedulable", body

    def scores(self, token_ids: list[int]) -> dict[int, int]:
        """The indexer's overlap per worker, in tokens (workers holding nothing are absent)."""
        status, body = call(f"http://127.0.0.1:{self.indexer_port}/query", {"token_ids": token_ids,
                                                                           "model_name": self.model})
        assert status == 200, body
        return {int(worker): ranks["0"] for worker, ranks in body["scores"].items() if ranks.get("0")}

    def select(self, token_ids: list[int]) -> tuple[int, int]:
        """(the worker Dynamo's selection service picks, its overlap in tokens)."""
        status, body = call(f"http://127.0.0.1:{self.select_port}/select", {"token_ids": token_ids,
                                                                           "model_name": self.model})
        assert status == 200, body
        return body["worker_id"], body["overlap"]["longest_matched"]

    def wait_scores(self, token_ids: list[int], expected, what: str) -> dict[int, int]:
        deadline = time.monotonic() + SETTLE_S
        while True:
            scores = self.scores(token_ids)
            if expected(scores):
                return scores
            assert time.monotonic() < deadline, f"{what}: Dynamo's scores are still {scores}"
            time.sleep(0.1)

    def wait_select(self, token_ids: list[int], expected, what: str) -> tuple[int, int]:
        """``select`` until ``expected((worker, overlap))``: the selection service reads the events on
        its own, so it may lag the indexer (a gap it replays, say)."""
        deadline = time.monotonic() + SETTLE_S
        while not expected(selected := self.select(token_ids)):
            assert time.monotonic() < deadline, f"{what}: Dynamo still selects {selected}"
            time.sleep(0.1)
        return selected

    def wait_selected_overlap(self, token_ids: list[int], overlap: int, what: str) -> None:
        """The selection service reads the events on its own, so it may lag the indexer."""
        deadline = time.monotonic() + SETTLE_S
        while (selected := self.select(token_ids))[1] != overlap:
            assert time.monotonic() < deadline, f"{what}: Dynamo still selects {selected}"
            time.sleep(0.1)

    def stop(self) -> None:
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
