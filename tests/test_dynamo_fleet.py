"""A fleet of two real ``kvplug serve`` workers routed by NVIDIA Dynamo's KV router (issue 27), on 127.0.0.1.

Dynamo's standalone indexer (``python -m dynamo.indexer``) and selection service (``python -m
dynamo.select_service``), from ``ai-dynamo-runtime==1.6.1`` in an environment of their own
(``KVPLUG_DYNAMO_PYTHON``; ``bash scripts/test-dynamo-fleet.sh`` builds it and runs this file),
read both workers' ``--kv-events-config`` streams. A conversation's next turn is selected for the
worker that holds its prefix, which then reports the hit; a flush and an eviction remove the score;
a restarted worker leaves no stale score.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests import serve_process
from tests.dynamo_router import Dynamo, call, dynamo_python  # noqa: F401  (fixture)
from tests.test_serve import cache_dir, embedded  # noqa: F401  (fixtures)

pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed: pip install -e '.[events]'")
MODEL = "kvplug-default"
PAGE = 16


class Worker:
    """One ``kvplug serve`` publishing its KV events on fixed ports (kept across a restart)."""

    def __init__(self, worker_id: int, cache: Path, logs: Path) -> None:
        self.worker_id = worker_id
        self.port, self.events_port, self.replay_port = (serve_process.free_port() for _ in range(3))
        self.cache, self.logs, self.runs = cache, logs, 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.runs += 1
        self.log = self.logs / f"worker{self.worker_id}-run{self.runs}.log"
        config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.events_port}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}", "topic": ""}
        self.process = serve_process.start(
            ["-m", "kvplug", "serve", "--port", str(self.port), "--kv-memory", "4MiB", "--max-seq-len", "512",
             "--page-size", str(PAGE), "--max-running-reqs", "4", "--kv-events-config", json.dumps(config)],
            self.cache, self.log)

    def wait_ready(self) -> None:
        serve_process.wait_ready(self.process, self.port, self.log)

    def stop(self) -> None:
        code, _ = serve_process.stop(self.process)
        assert code == 0, self.log.read_text()[-3000:]

    def chat(self, messages: list) -> dict:
        status, body = call(f"{self.url}/v1/chat/completions", {"messages": messages, "max_tokens": 4})
        assert status == 200, body
        return body

    def hit_tokens(self) -> int:
        return call(f"{self.url}/kvplug/stats")[1]["cache_hit_tokens"]


@pytest.fixture(scope="module")
def fleet(dynamo_python, embedded, cache_dir, tmp_path_factory):  # noqa: F811
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    logs = tmp_path_factory.mktemp("fleet-logs")
    workers = {worker_id: Worker(worker_id, cache_dir, logs) for worker_id in (1, 2)}
    for worker in workers.values():
        worker.start()
    dynamo = None
    try:
        for worker in workers.values():
            worker.wait_ready()
        dynamo = Dynamo(dynamo_python, logs, MODEL, PAGE)
        dynamo.wait_ready()
        for worker in workers.values():
            dynamo.register(worker)
        yield dynamo, workers
    finally:
        if dynamo is not None:
            dynamo.stop()
        for worker in workers.values():
            if worker.process is not None and worker.process.poll() is None:
                worker.stop()


def tokenize(worker: Worker, messages: list) -> list[int]:
    status, body = call(f"{worker.url}/tokenize", {"messages": messages})
    assert status == 200, body
    return body["tokens"]


def conversation(name: str) -> list:
    """A first turn; the name leads, so that two conversations share no page (the tokenizer is byte-level)."""
    return [{"role": "user", "content": f"{name}: tell me about {name} in detail, please. " * 3}]


def next_turn(messages: list, reply: dict) -> list:
    return messages + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                       {"role": "user", "content": "Go on, with an example. " * 2}]


def test_the_next_turn_goes_to_the_worker_holding_the_conversation(fleet):
    dynamo, workers = fleet
    for name, first_worker in (("radix trees", 1), ("paged attention", 2)):
        turn1 = conversation(name)
        ids1 = tokenize(workers[1], turn1)
        assert dynamo.scores(ids1) == {}
        reply = workers[first_worker].chat(turn1)
        held = len(ids1) // PAGE * PAGE
        scores = dynamo.wait_scores(ids1, lambda s: s.get(first_worker, 0) >= held, "after the first turn")
        assert set(scores) == {first_worker}  # the other worker never saw it
        turn2 = next_turn(turn1, reply)
        ids2 = tokenize(workers[1], turn2)
        chosen, overlap = dynamo.select(ids2)
        assert chosen == first_worker and overlap >= held - PAGE
        hits = workers[chosen].hit_tokens()
        workers[chosen].chat(turn2)
        assert workers[chosen].hit_tokens() - hits >= overlap  # the worker Dynamo chose reports the cached tokens


def test_a_flush_removes_the_score(fleet):
    dynamo, workers = fleet
    turn1 = conversation("CUDA graphs")
    ids1 = tokenize(workers[1], turn1)
    workers[1].chat(turn1)
    dynamo.wait_scores(ids1, lambda s: s.get(1, 0) > 0, "after the chat")
    status, body = call(f"{workers[1].url}/flush_cache", {})
    assert status == 200 and body["freed_pages"] > 0
    dynamo.wait_scores(ids1, lambda s: 1 not in s, "after /flush_cache")
    dynamo.wait_selected_overlap(ids1, 0, "after /flush_cache")


def test_an_eviction_removes_the_score(fleet):
    dynamo, workers = fleet
    first = conversation("pinned memory")
    ids = tokenize(workers[2], first)
    workers[2].chat(first)
    dynamo.wait_scores(ids, lambda s: s.get(2, 0) > 0, "after the chat")
    topic = 0
    while dynamo.scores(ids).get(2, 0) > 0:  # other prompts push it out of worker 2's small pool
        assert topic < 40, "worker 2 never evicted the first conversation"
        workers[2].chat(conversation(f"{topic} other things"))
        topic += 1
        time.sleep(0.3)  # the events of the last step reach Dynamo
    assert topic > 1 and dynamo.scores(ids) == {}


def test_a_restarted_worker_leaves_no_stale_score(fleet):
    dynamo, workers = fleet
    turn1 = conversation("prefix caching")
    ids1 = tokenize(workers[1], turn1)
    workers[1].chat(turn1)
    dynamo.wait_scores(ids1, lambda s: s.get(1, 0) > 0, "after the chat")
    workers[1].stop()
    workers[1].start()  # the same ports: Dynamo's sockets reconnect by themselves
    workers[1].wait_ready()
    dynamo.wait_scores(ids1, lambda s: 1 not in s, "after the restart")
    dynamo.wait_selected_overlap(ids1, 0, "after the restart")
    workers[1].chat(turn1)  # and the restarted worker's events are read again
    dynamo.wait_scores(ids1, lambda s: s.get(1, 0) > 0, "after a chat on the restarted worker")
