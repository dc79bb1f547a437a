"""``kvplug serve --kv-events-config`` (issue 27), a real server on 127.0.0.1 with the embedded model:
a ZMQ SUB reads ``BlockStored`` for a chat's prompt pages, replay answers from the start of the run,
``/flush_cache`` gives ``AllBlocksCleared``, the host tier publishes ``CPU_PINNED``, and a bad
config is a one-line start-up error naming the key."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests import serve_process
from tests.kv_events_support import Subscriber, replay, zmq
from tests.test_serve import cache_dir, embedded, server_deps  # noqa: F401  (fixtures)

PAGE = 16


def events_config(events_port: int, replay_port: int, **keys) -> str:
    return json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}",
                       "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv-events", **keys})


def chat(port: int, messages: list, max_tokens: int = 4) -> dict:
    status, body = serve_process.post(port, "/v1/chat/completions",
                                      json.dumps({"messages": messages, "max_tokens": max_tokens}).encode())
    assert status == 200, body
    return body


def prompt_ids(port: int, messages: list) -> list[int]:
    status, body = serve_process.post(port, "/tokenize", json.dumps({"messages": messages}).encode())
    assert status == 200, body
    return body["tokens"]


def stored_until(sub: Subscriber, predicate, sequences: list, timeout: float = 30) -> list:
    """Events of every batch read until one satisfies ``predicate``; their sequence numbers go to ``sequences``."""
    seen: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _, sequence, batch = sub.receive()
        except zmq.Again:
            continue
        sequences.append(sequence)
        seen.extend(batch.events)
        if any(predicate(event) for event in batch.events):
            return seen
    pytest.fail(f"no matching event within {timeout} s; saw {[event['type'] for event in seen]}")


def test_a_chat_is_published_replayed_and_flushed(server_deps, cache_dir, tmp_path):  # noqa: F811
    port, events_port, replay_port = (serve_process.free_port() for _ in range(3))
    log = tmp_path / "serve.log"
    started_us = time.time_ns() // 1000
    process = serve_process.start(
        ["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "8MiB", "--max-seq-len", "512", "--page-size",
         str(PAGE), "--max-running-reqs", "4", "--kv-events-config", events_config(events_port, replay_port)],
        cache_dir, log)
    sub = None
    try:
        stats = serve_process.wait_ready(process, port, log)
        events = stats["kv_events"]
        assert (events["publisher"], events["endpoint"], events["topic"]) == ("zmq", f"tcp://127.0.0.1:{events_port}",
                                                                            "kv-events")
        sub = Subscriber(f"tcp://127.0.0.1:{events_port}", b"kv-events")
        topic, first, batch = sub.receive()  # the subscription is answered at once, with the current number
        assert topic == b"kv-events" and batch.events == [] and batch.data_parallel_rank == 0
        assert started_us < first < time.time_ns() // 1000  # numbered from the start time, never from 0
        # what was published before this subscriber came: the run starts with AllBlocksCleared
        history = replay(f"tcp://127.0.0.1:{replay_port}", 0)
        assert history[0][1].events[0] == {"type": "AllBlocksCleared"}
        assert [sequence for sequence, _ in history] == list(range(history[0][0], first + 1))

        sequences = [first]
        turn1 = [{"role": "user", "content": "Conversation one: explain radix trees and paged attention. " * 3}]
        ids1 = prompt_ids(port, turn1)
        reply = chat(port, turn1)
        seen = stored_until(sub, lambda event: event["type"] == "BlockStored", sequences)
        stored = [event for event in seen if event["type"] == "BlockStored"]
        assert len(stored) == 1
        first_store = stored[0]
        whole = len(ids1) // PAGE * PAGE
        assert first_store["token_ids"][:whole] == ids1[:whole]  # the prompt's pages, in order
        assert len(first_store["token_ids"]) == len(first_store["block_hashes"]) * PAGE
        assert (first_store["parent_block_hash"], first_store["block_size"], first_store["medium"]) == (None, PAGE,
                                                                                                     "GPU")
        assert len(set(first_store["block_hashes"])) == len(first_store["block_hashes"])

        # the next turn of the conversation hits its prefix and stores only what follows, chained to it
        hits_before = serve_process.get_json(port, "/kvplug/stats")[1]["cache_hit_tokens"]
        turn2 = turn1 + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And now CUDA graphs, please. " * 3}]
        chat(port, turn2)
        seen = stored_until(sub, lambda event: event["type"] == "BlockStored", sequences)
        second_store = next(event for event in seen if event["type"] == "BlockStored")
        assert second_store["parent_block_hash"] in first_store["block_hashes"]
        assert serve_process.get_json(port, "/kvplug/stats")[1]["cache_hit_tokens"] > hits_before

        status, flushed = serve_process.post(port, "/flush_cache", b"")
        assert status == 200 and flushed["status"] == "ok" and flushed["freed_pages"] > 0
        stored_until(sub, lambda event: event["type"] == "AllBlocksCleared", sequences)
        status, flushed = serve_process.post(port, "/reset_prefix_cache", b"")  # vLLM's name for it
        assert status == 200 and flushed["freed_pages"] == 0
        stored_until(sub, lambda event: event["type"] == "AllBlocksCleared", sequences)
        assert sequences == list(range(first, first + len(sequences)))  # nothing lost on the way

        # after a flush the replay still answers for every number of this run
        assert [sequence for sequence, _ in replay(f"tcp://127.0.0.1:{replay_port}", first)] == sequences
        counters = serve_process.get_json(port, "/kvplug/stats")[1]["kv_events"]
        assert counters["dropped_batches"] == 0 and counters["published_batches"] >= len(history) + len(sequences) - 1
        assert counters["replay_requests"] == 2
    finally:
        if sub is not None:
            sub.close()
        code, _ = serve_process.stop(process)
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert f"publishing KV events on tcp://127.0.0.1:{events_port}" in output and "Traceback" not in output


def test_the_host_tier_publishes_its_pages_as_cpu_pinned(server_deps, cache_dir, tmp_path):  # noqa: F811
    port, events_port, replay_port = (serve_process.free_port() for _ in range(3))
    log = tmp_path / "serve.log"
    process = serve_process.start(
        ["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "1536KiB", "--max-seq-len", "256",
         "--page-size", str(PAGE), "--max-running-reqs", "2", "--host-memory", "16MiB",
         "--kv-events-config", events_config(events_port, replay_port)], cache_dir, log)
    sub = None
    try:
        serve_process.wait_ready(process, port, log)
        sub = Subscriber(f"tcp://127.0.0.1:{events_port}")
        sub.receive()
        for number, topic in enumerate(["paged attention", "radix trees", "CUDA graphs", "pinned memory"]):
            chat(port, [{"role": "user", "content": f"Question {number} about {topic}: " + f"explain {topic}. " * 5}])
        seen = stored_until(sub, lambda event: event.get("medium") == "CPU_PINNED", [])
        media = {(event["type"], event.get("medium")) for event in seen}
        # a write-back: the pages leave the KV pool and are stored in host memory
        assert {("BlockRemoved", "GPU"), ("BlockStored", "CPU_PINNED"), ("BlockStored", "GPU")} <= media
        status, body = serve_process.post(port, "/flush_cache", b"")
        assert status == 400 and "host tier" in body["error"]["message"]
    finally:
        if sub is not None:
            sub.close()
        code, _ = serve_process.stop(process)
    assert code == 0, log.read_text()[-4000:]


def test_a_bad_config_is_a_one_line_start_up_error_naming_the_key(tmp_path):
    for config, named in (('{"endpont": "tcp://127.0.0.1:5557"}', "unknown key 'endpont'"),
                          ('{"hwm": 0}', "'hwm' must be an int >= 1")):
        result = subprocess.run(
            [sys.executable, "-m", "kvplug", "serve", "--port", str(serve_process.free_port()),
             "--kv-events-config", config],
            capture_output=True, text=True, timeout=120, env=serve_process.kvplug_env(tmp_path / "never-built"),
        )
        assert result.returncode == 2, result.stderr[-2000:]
        assert named in result.stderr and "--kv-events-config" in result.stderr and "Traceback" not in result.stderr
        assert not (tmp_path / "never-built").exists()  # refused before anything loaded


def test_an_events_address_in_use_fails_the_start(server_deps, cache_dir, tmp_path):  # noqa: F811
    busy = zmq.Context.instance().socket(zmq.PUB)
    events_port = busy.bind_to_random_port("tcp://127.0.0.1")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "kvplug", "serve", "--port", str(serve_process.free_port()), "--kv-memory", "8MiB",
             "--max-seq-len", "256", "--kv-events-config",
             json.dumps({"endpoint": f"tcp://127.0.0.1:{events_port}"})],
            capture_output=True, text=True, timeout=180, env=serve_process.kvplug_env(cache_dir),
        )
    finally:
        busy.close(linger=0)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"cannot bind 'endpoint' 'tcp://127.0.0.1:{events_port}'" in result.stderr
    assert "Traceback" not in result.stderr
