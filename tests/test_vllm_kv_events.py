"""kvplug's KV events through a real ``vllm serve`` (vLLM 0.32.0's CPU build, issue 27): vLLM's own ZMQ
publisher (``--kv-events-config``) carries kvplug's cache changes, read by a SUB socket on 127.0.0.1
and decoded with vLLM's own ``KVEventBatch`` decoder, as a router reads them: ``BlockStored`` for a
prompt's whole blocks (token ids, block size, chained parent hashes, medium ``GPU``),
``BlockRemoved`` for kvplug's evictions in a pool of 16 blocks, ``AllBlocksCleared`` (and the
removal of every block still cached) on ``POST /reset_prefix_cache``. About two minutes.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test-vllm-host.sh builds its environment)")
zmq = pytest.importorskip("zmq", reason="pyzmq is not installed")
msgspec = pytest.importorskip("msgspec", reason="msgspec is not installed")

from tests.test_vllm_server import (  # noqa: E402
    connector_config, free_port, model_dir, openai, start, stop, tail, wait_ready,  # noqa: F401
)

BLOCK = 128


class Events:
    """A SUB socket on vLLM's publisher; ``drain`` decodes every batch received so far."""

    def __init__(self, port: int) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sequences: list[int] = []

    def drain(self, wait_s: float = 3.0) -> list:
        events, deadline = [], time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not self.sock.poll(200):
                continue
            topic, sequence, payload = self.sock.recv_multipart()
            assert topic == b"kv"
            self.sequences.append(int.from_bytes(sequence, "big"))
            events.extend(self.decoder.decode(payload).events)
        return events

    def close(self) -> None:
        self.sock.close(linger=0)


def test_the_recorder_turns_kvplugs_events_into_vllms() -> None:
    """Without a server: kvplug's radix events become vLLM's classes, a quarantine clears, and what
    one step produced is taken once."""
    import kvplug
    from kvplug_vllm.block_cache import BlockPrefixCache
    from kvplug_vllm.kv_events import VLLMEventRecorder
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    from tests.test_vllm_cache_faults import faulty_cache
    from tests.test_vllm_compat import RefModel

    model, recorder = RefModel(8), VLLMEventRecorder()
    cache = BlockPrefixCache(lambda: kvplug.create_prefix_cache("radix", page_size=4), 4, model.take, model.drop,
                             listener=recorder)
    tokens, blocks = list(range(9)), model.allocate(2)
    cache.insert("a", tokens, blocks)
    model.drop(blocks)
    stored = recorder.take()
    assert [type(event) for event in stored] == [BlockStored]
    assert stored[0].token_ids == tokens[:8] and stored[0].block_size == 4 and stored[0].medium == "GPU"
    assert stored[0].parent_block_hash is None and len(stored[0].block_hashes) == 2
    assert recorder.take() == []
    assert cache.evict_blocks(2) == 2
    removed = recorder.take()
    assert all(type(event) is BlockRemoved and event.medium == "GPU" for event in removed)
    assert sorted(digest for event in removed for digest in event.block_hashes) == sorted(stored[0].block_hashes)

    model = RefModel(24)
    faulty = faulty_cache("insert_prefix:raise", 1, model)
    faulty._listener = recorder  # noqa: SLF001 (as install() passes it)
    blocks = model.allocate(2)
    faulty.insert("a", tokens, blocks)  # the second insert below raises: quarantined
    faulty.insert("a", [5] * 9, model.allocate(2))
    assert faulty.quarantine.failures == 1
    assert type(recorder.take()[-1]) is AllBlocksCleared


def kinds(events: list, name: str) -> list:
    return [event for event in events if type(event).__name__ == name]


def test_vllm_publishes_kvplugs_cache_changes(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    port, events_port, log = free_port(), free_port(), tmp_path / "serve-events.log"
    kv_events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                            "endpoint": f"tcp://*:{events_port}", "topic": "kv"})
    process = start(model_dir, port, connector_config(prefix_cache="radix"), log, max_model_len=1024,
                    kv_cache_bytes=16 * BLOCK * 1024, extra_args=("--kv-events-config", kv_events),
                    VLLM_SERVER_DEV_MODE="1")
    subscriber = None
    try:
        wait_ready(process, port, log)
        subscriber = Events(events_port)
        time.sleep(1.0)  # the SUB socket joins before anything is published
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        rng = random.Random(5)
        prompt = [rng.randrange(256) for _ in range(400)]
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
        stored = kinds(subscriber.drain(), "BlockStored")
        assert stored, tail(log)
        tokens = [token for event in stored for token in event.token_ids]
        assert tokens[: 3 * BLOCK] == prompt[: 3 * BLOCK]  # the prompt's three whole blocks, in order
        assert all(event.block_size == BLOCK and event.medium == "GPU" for event in stored)
        assert all(len(event.token_ids) == BLOCK * len(event.block_hashes) for event in stored)
        assert stored[0].parent_block_hash is None
        for before, after in zip(stored, stored[1:]):  # each event continues the previous one's chain
            assert after.parent_block_hash == before.block_hashes[-1]
        known = {digest for event in stored for digest in event.block_hashes}
        # pressure: 15 usable blocks, distinct prompts of 3 cached blocks each: kvplug evicts
        for _ in range(8):
            other = [rng.randrange(256) for _ in range(400)]
            client.completions.create(model="tiny", prompt=other, max_tokens=4, temperature=0)
        events = subscriber.drain()
        known |= {digest for event in kinds(events, "BlockStored") for digest in event.block_hashes}
        removed = kinds(events, "BlockRemoved")
        assert removed, "no BlockRemoved under eviction pressure"
        assert all(event.medium == "GPU" and set(event.block_hashes) <= known for event in removed)
        assert set(stored[0].block_hashes) & {digest for event in removed for digest in event.block_hashes}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        # published with the next step's events: the clear (vLLM's pool reports it first in the batch)
        # and kvplug's removals of what it still held
        client.completions.create(model="tiny", prompt=prompt[:100], max_tokens=2, temperature=0)
        events = subscriber.drain()
        assert kinds(events, "AllBlocksCleared"), [type(event).__name__ for event in events]
        removed += kinds(events, "BlockRemoved")
        assert {digest for event in removed for digest in event.block_hashes} == known  # all gone
        assert not kinds(events, "BlockStored")  # 100 tokens: no whole block
        assert subscriber.sequences == sorted(subscriber.sequences)
    finally:
        if subscriber is not None:
            subscriber.close()
        status = stop(process, log) if process.poll() is None else process.returncode
    assert status == 0, f"vllm serve exited with {status} after SIGTERM:\n{tail(log)}"
