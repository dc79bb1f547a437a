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
import torch

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


def vllm_request(request_id: str, tokens: list, block_size: int, salt=None, lora=None):
    """A real vLLM request whose ``block_hashes`` vLLM's own hasher computes (sha256, as the engine's default)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(request_id, list(tokens), SamplingParams(max_tokens=1), None, cache_salt=salt, lora_request=lora,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def native_stored(request, num_blocks: int, block_size: int) -> list:
    """What vLLM's own block pool publishes when it caches ``request``'s first ``num_blocks`` blocks."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_blocks + 1, enable_caching=True, hash_block_size=block_size, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(num_blocks), 0, num_blocks, block_size, 0)
    return pool.take_events()


def test_published_hashes_are_vllms_own_per_namespace() -> None:
    """The same token ids under no namespace, two salts and two LoRA adapters (one re-pointed at other
    weights): kvplug's BlockStored equals what vLLM's own block pool publishes for that request, field
    by field, so the five namespaces publish five different hash chains."""
    import kvplug
    from kvplug_vllm.block_cache import BlockPrefixCache
    from kvplug_vllm.kv_events import VLLMEventRecorder
    from kvplug_vllm.namespaces import namespace_of
    from vllm.lora.request import LoRARequest

    from tests.test_vllm_compat import RefModel

    model, recorder = RefModel(64), VLLMEventRecorder(4)
    cache = BlockPrefixCache(lambda: kvplug.create_prefix_cache("radix", page_size=4), 4, model.take, model.drop,
                             events=recorder)
    tokens = list(range(13))
    variants = [{}, {"salt": "tenant-a"}, {"salt": "tenant-b"},
                {"lora": LoRARequest("sql", 1, "/adapters/sql")}, {"lora": LoRARequest("sql", 1, "/adapters/sql-v2")}]
    chains = []
    for number, variant in enumerate(variants):
        request = vllm_request(f"r{number}", tokens, 4, **variant)
        blocks = model.allocate(3)
        cache.insert(namespace_of(request), request.all_token_ids, blocks, context=request)
        model.drop(blocks)
        ours, native = recorder.take(), native_stored(request, 3, 4)
        assert ours == native, (variant, ours, native)
        chains.append(tuple(ours[0].block_hashes))
    assert len(set(chains)) == len(variants) and len({h for chain in chains for h in chain}) == 3 * len(variants)
    assert cache.namespaces == len(variants) and recorder.unmatched_pages == 0

    # a continuation chains to the cached prefix, again as vLLM's pool publishes it
    longer = vllm_request("r-long", tokens + [7] * 7, 4, salt="tenant-a")
    blocks = model.allocate(5)
    cache.insert(namespace_of(longer), longer.all_token_ids, blocks, context=longer)
    (stored,) = recorder.take()
    native = native_stored(longer, 5, 4)[0]
    assert stored.block_hashes == native.block_hashes[3:] and stored.parent_block_hash == native.block_hashes[2]
    assert stored.token_ids == native.token_ids[12:] and stored.extra_keys == native.extra_keys[3:]

    # eviction removes by the published hashes
    model.drop(blocks)
    cache.evict_blocks(100)
    removed = {h for event in recorder.take() for h in event.block_hashes}
    assert removed == {h for chain in chains for h in chain} | set(stored.block_hashes)


def test_the_host_tier_republishes_the_same_hashes_on_cpu_pinned() -> None:
    """A tiered radix over a host pool: an eviction writes the blocks back (BlockRemoved GPU, BlockStored
    CPU_PINNED with the same hashes, parents and tokens), a load stores them on GPU again, dropping
    them from host memory removes them there; a clear replaces what the step had so far."""
    from kvplug_vllm.block_cache import BlockPrefixCache
    from kvplug_vllm.connector import prefix_cache_factory
    from kvplug_vllm.host_copies import RecordedHostPool
    from kvplug_vllm.kv_events import VLLMEventRecorder
    from kvplug_vllm.namespaces import namespace_of
    from kvplug_vllm.settings import parse_settings
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    from tests.test_vllm_compat import RefModel

    model, recorder = RefModel(16), VLLMEventRecorder(4)
    pool = RecordedHostPool(3, 4, bytes_per_page=64)
    factory = prefix_cache_factory(parse_settings({"prefix_cache": "radix", "host_memory": 1 << 20}), 4, 16, pool)
    cache = BlockPrefixCache(factory, 4, model.take, model.drop, events=recorder)
    first = vllm_request("a", list(range(9)), 4, salt="s")
    blocks = model.allocate(2)
    cache.insert(namespace_of(first), first.all_token_ids, blocks, context=first)
    model.drop(blocks)
    (stored,) = recorder.take()
    assert cache.evict_blocks(2) == 2
    events = recorder.take()
    assert [(type(e), e.medium) for e in events] == [(BlockRemoved, "GPU"), (BlockStored, "CPU_PINNED")]
    on_host = [e for e in events if type(e) is BlockStored]
    assert sorted(h for e in on_host for h in e.block_hashes) == sorted(stored.block_hashes)
    assert sorted(h for e in events if type(e) is BlockRemoved for h in e.block_hashes) == sorted(stored.block_hashes)
    assert on_host[0].token_ids == stored.token_ids and on_host[0].parent_block_hash is None
    assert all(e.extra_keys is not None and e.block_size == 4 for e in on_host)

    # load the host prefix back into two new blocks: stored on GPU again, same hashes
    space = cache.space(namespace_of(first))
    found = space.cache.match_tiered(torch.tensor(first.all_token_ids[:8], dtype=torch.int32))
    assert found.host_len == 8
    targets = model.allocate(2)
    space.cache.load_host_prefix(found.host_handle, torch.tensor([b * 4 + i for b in targets for i in range(4)],
                                                                  dtype=torch.int32))
    cache.adopt_loaded(targets)
    model.drop(targets)
    loaded = recorder.take()
    assert [(type(e), e.medium) for e in loaded] == [(BlockStored, "GPU")] * len(loaded)
    assert sorted(h for e in loaded for h in e.block_hashes) == sorted(stored.block_hashes)

    # a second prefix fills the 3 host pages: the first one's host copies are dropped, removed on CPU_PINNED
    other = vllm_request("b", [50 + t for t in range(9)], 4, salt="s")
    blocks = model.allocate(2)
    cache.insert(namespace_of(other), other.all_token_ids, blocks, context=other)
    model.drop(blocks)
    recorder.take()
    cache.evict_blocks(16)
    events = recorder.take()
    dropped = {h for e in events if type(e) is BlockRemoved and e.medium == "CPU_PINNED" for h in e.block_hashes}
    assert dropped and dropped <= set(stored.block_hashes)
    assert recorder.unmatched_pages == 0

    # a reset: whatever the step reported before the clear is superseded by it
    assert cache.reset() and recorder.take() == [AllBlocksCleared()]


def test_two_namespaces_holding_one_hash_publish_it_once() -> None:
    """Blocks of one vLLM hash in two namespaces (text before different images: vLLM would share them,
    kvplug keeps them apart): stored once, removed when the last holder evicts it."""
    import kvplug
    from kvplug_vllm.block_cache import BlockPrefixCache
    from kvplug_vllm.kv_events import VLLMEventRecorder

    from tests.test_vllm_compat import RefModel

    model, recorder = RefModel(16), VLLMEventRecorder(4)
    cache = BlockPrefixCache(lambda: kvplug.create_prefix_cache("radix", page_size=4), 4, model.take, model.drop,
                             events=recorder)
    request = vllm_request("r", list(range(9)), 4)
    for namespace in ("image-1", "image-2"):
        blocks = model.allocate(2)
        cache.insert(namespace, request.all_token_ids, blocks, context=request)
        model.drop(blocks)
    stored = recorder.take()
    assert len(stored) == 1 and stored == native_stored(request, 2, 4)
    cache.space("image-2")  # image-1 is the least recently used namespace: evicted first
    assert cache.evict_blocks(2) == 2 and recorder.take() == []
    assert cache.evict_blocks(2) == 2
    assert sorted(h for e in recorder.take() for h in e.block_hashes) == sorted(stored[0].block_hashes)


def test_a_quarantine_clears_what_was_published() -> None:
    from kvplug_vllm.kv_events import VLLMEventRecorder
    from vllm.distributed.kv_events import AllBlocksCleared

    from tests.test_vllm_cache_faults import faulty_cache
    from tests.test_vllm_compat import RefModel

    model, recorder = RefModel(24), VLLMEventRecorder(4)
    faulty = faulty_cache("insert_prefix:raise", 1, model)
    faulty._events = recorder  # noqa: SLF001 (as install() passes it)
    request = vllm_request("q", list(range(9)), 4)
    faulty.insert("a", request.all_token_ids, model.allocate(2), context=request)
    faulty.insert("a", [5] * 9, model.allocate(2))  # the second raises: quarantined
    assert faulty.quarantine.failures == 1
    assert recorder.take() == [AllBlocksCleared()]


def replay(batches: list) -> dict:
    """A router's view of the events: the hashes held per medium (with their token ids), checking that
    a parent is held when a child is stored, a removal names a held hash, a hash means one block."""
    held: dict = {}
    for batch in batches:
        for event in batch:
            if event["type"] == "AllBlocksCleared":
                held.clear()
                continue
            medium = held.setdefault(event["medium"], {})
            if event["type"] == "BlockRemoved":
                for digest in event["block_hashes"]:
                    assert medium.pop(digest, None) is not None, f"{digest} removed from {event['medium']} unheld"
                continue
            parent, size = event["parent_block_hash"], event["block_size"]
            assert parent is None or any(parent in tier for tier in held.values()), f"orphan {event}"
            for number, digest in enumerate(event["block_hashes"]):
                tokens = tuple(event["token_ids"][number * size:(number + 1) * size])
                assert digest not in medium, f"{digest} stored twice on {event['medium']}"
                assert all(tier.get(digest, tokens) == tokens for tier in held.values()), "one hash, two blocks"
                medium[digest] = tokens
    return held


def stored_blocks(batches: list, medium: str = "GPU") -> dict:
    """hash -> (parent, token ids) of every block stored on ``medium``."""
    blocks = {}
    for event in (e for batch in batches for e in batch if e["type"] == "BlockStored" and e["medium"] == medium):
        parent, size = event["parent_block_hash"], event["block_size"]
        for number, digest in enumerate(event["block_hashes"]):
            blocks[digest] = (parent, tuple(event["token_ids"][number * size:(number + 1) * size]))
            parent = digest
    return blocks


def test_engine_publishes_what_native_vllm_publishes(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """A real engine, prompts sharing a prefix, then again, then under two cache_salt values: kvplug's
    radix publishes exactly native vLLM's BlockStored events (hashes, parents, tokens, extra keys),
    the salted prompts under other hashes than the plain ones; a reset leaves nothing held."""
    from tests.test_vllm_host import run_engine

    native = run_engine(model_dir, "events", "native", tmp_path, events=True)
    ours = run_engine(model_dir, "events", "radix", tmp_path, events=True)
    assert ours["rounds"] == native["rounds"] and ours["unmatched_pages"] == 0
    native_stored = [e for batch in native["events"] for e in batch if e["type"] == "BlockStored"]
    ours_stored = [e for batch in ours["events"] for e in batch if e["type"] == "BlockStored"]
    assert ours_stored == native_stored and len(ours_stored) == 6
    salts = [event["extra_keys"][0] for event in ours_stored if event["parent_block_hash"] is None]
    assert salts == [None, ["tenant-a"], ["tenant-b"]]
    roots = [event["block_hashes"][0] for event in ours_stored if event["parent_block_hash"] is None]
    assert len(set(roots)) == 3  # equal token ids, three namespaces, three hashes
    assert replay(ours["events"]) == {} and ours["events"][-1] == [{"type": "AllBlocksCleared"}] * 2


@pytest.mark.parametrize(("workload", "host_memory"), [("host", "8MiB"), ("pressure", "2MiB")])
def test_engine_publishes_the_host_tier_on_cpu_pinned(model_dir: Path, tmp_path: Path, workload: str,  # noqa: F811
                                                      host_memory: str) -> None:
    """With host_memory: a write-back is BlockRemoved GPU + BlockStored CPU_PINNED of the same hashes, a
    host hit stores them on GPU again, a full host tier removes its oldest on CPU_PINNED; every hash
    kvplug publishes is one native vLLM publishes for the same block; the router's view stays
    consistent and is empty after the reset."""
    from tests.test_vllm_host import run_engine

    native = run_engine(model_dir, workload, "native", tmp_path, events=True)
    ours = run_engine(model_dir, workload, "radix", tmp_path, {"host_memory": host_memory}, events=True)
    assert ours["rounds"][0]["tokens"] == native["rounds"][0]["tokens"] and ours["unmatched_pages"] == 0
    stats = ours["kvplug"]
    assert stats["host_write_backs"] > 0 and stats["host_hits"] > 0
    gpu, host = stored_blocks(ours["events"]), stored_blocks(ours["events"], "CPU_PINNED")
    assert host and set(host) <= set(gpu)  # written back: blocks stored on GPU before
    assert all(gpu[digest][1] == host[digest][1] for digest in host)
    native_gpu = stored_blocks(native["events"])
    assert gpu == {digest: native_gpu.get(digest) for digest in gpu}  # native's hashes for the same blocks
    removed = [e for batch in ours["events"] for e in batch if e["type"] == "BlockRemoved"]
    cpu_removed = {d for e in removed if e["medium"] == "CPU_PINNED" for d in e["block_hashes"]}
    if workload == "pressure":  # 16 host pages fill up: the oldest are dropped
        assert cpu_removed and cpu_removed <= set(host)
    reloaded = [e for batch in ours["events"][1:] for e in batch
                if e["type"] == "BlockStored" and e["medium"] == "GPU" and set(e["block_hashes"]) <= set(host)]
    assert reloaded  # host hits stored on GPU again under their hashes
    held = replay(ours["events"])
    assert set(held) <= {"GPU", "CPU_PINNED"} and not held.get("CPU_PINNED")


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
        # published with the next step's events: vLLM's pool's clear first in the batch, then kvplug's,
        # which supersedes the removals of what kvplug still held (nothing may follow a clear)
        client.completions.create(model="tiny", prompt=prompt[:100], max_tokens=2, temperature=0)
        events = subscriber.drain()
        assert [type(event).__name__ for event in events] == ["AllBlocksCleared", "AllBlocksCleared"], events
        assert {digest for event in removed for digest in event.block_hashes} < known  # some were still held
        assert subscriber.sequences == sorted(subscriber.sequences)
    finally:
        if subscriber is not None:
            subscriber.close()
        status = stop(process, log) if process.poll() is None else process.returncode
    assert status == 0, f"vllm serve exited with {status} after SIGTERM:\n{tail(log)}"
