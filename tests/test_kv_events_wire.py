"""KV events on the wire (``kvplug.events``, issue 27): vLLM's and SGLang's ZMQ format, read back by
field position as routers (Dynamo) read it; the publisher's sequence numbers, replay socket, drops
and subscriptions; the ``--kv-events-config`` keys. Real ZMQ sockets (inproc and 127.0.0.1)."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import threading
import time

import pytest
import torch

import kvplug
from kvplug.events import KVEventCollector, KVEventsConfig, create_publisher, parse_kv_events_config
from kvplug.events.publisher import EventBatch, NullEventPublisher
from kvplug.events.wire import END_OF_REPLAY, decode_batch, encode_batch, sequence_number, wire_event
from kvplug.interface import AllCleared, BlockRemoved, BlockStored, InvalidArgumentError, KVPlugError
from tests.kv_events_support import Subscriber, replay, zmq
from tests.test_kv_events import radix_prefixes

_ENDPOINTS = itertools.count()


def inproc() -> str:
    return f"inproc://kvplug-events-test-{os.getpid()}-{next(_ENDPOINTS)}"


def ids(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


# ---------------------------------------------------------------------------- the payload, by position
# vLLM 0.32's own encoder (msgspec, vllm.distributed.kv_events.KVEventBatch) on this batch:
#   KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
#     BlockStored(block_hashes=[1, -2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
#                 lora_id=None, medium="GPU", lora_name=None),
#     BlockRemoved(block_hashes=[3], medium="CPU"), AllBlocksCleared()])
VLLM_BYTES = bytes.fromhex(
    "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201feb1706172656e"
    "745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d"
    "656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573"
    "9103a66d656469756da343505581a474797065b0416c6c426c6f636b73436c656172656400"
)


def test_payload_is_byte_for_byte_what_vllms_encoder_writes():
    # kvplug writes "CPU_PINNED" for its host tier where vLLM writes "CPU": the removal is given
    # here in vLLM's spelling, which kvplug passes through unchanged
    events = [BlockStored((1, -2), None, (1, 2, 3, 4), 2, "GPU"), BlockRemoved((3,), "VLLM-CPU"), AllCleared()]
    ours = encode_batch(1.5, events, 0)
    assert ours.replace(b"\xa8VLLM-CPU", b"\xa3CPU") == VLLM_BYTES


@pytest.mark.skipif(not os.environ.get("KVPLUG_VLLM_PYTHON"),
                    reason="set KVPLUG_VLLM_PYTHON to a Python with vLLM installed to decode with vLLM's structs")
def test_vllms_own_decoder_reads_the_payload():
    events = [BlockStored((7, 8), 5, tuple(range(8)), 4, "GPU"), BlockRemoved((7,), "CPU"), AllCleared()]
    payload = encode_batch(12.25, events, 0)
    script = (
        "import sys, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch\n"
        "batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(bytes.fromhex(sys.argv[1]))\n"
        "print([batch.ts, batch.data_parallel_rank, [type(e).__name__ for e in batch.events],"
        " batch.events[0].block_hashes, batch.events[0].parent_block_hash, batch.events[0].token_ids,"
        " batch.events[0].block_size, batch.events[0].medium, batch.events[1].block_hashes])\n"
    )
    out = subprocess.run([os.environ["KVPLUG_VLLM_PYTHON"], "-c", script, payload.hex()], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(
        [12.25, 0, ["BlockStored", "BlockRemoved", "AllBlocksCleared"], [7, 8], 5, list(range(8)), 4, "GPU", [7]])


def test_each_field_by_position_and_name():
    stored = BlockStored((11, -12), 10, tuple(range(6)), 3, "CPU")  # "CPU": kvplug's host tier
    batch = decode_batch(encode_batch(99.5, [stored, BlockRemoved((11,)), AllCleared()], 3))
    timestamp, events, rank = batch  # [timestamp, events, dp_rank], as Dynamo reads it
    assert (timestamp, rank, len(events)) == (99.5, 3, 3)
    assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name"]  # vLLM's field order
    assert events[0] == {"type": "BlockStored", "block_hashes": [11, -12], "parent_block_hash": 10,
                         "token_ids": [0, 1, 2, 3, 4, 5], "block_size": 3, "lora_id": None,
                         "medium": "CPU_PINNED", "lora_name": None}
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}
    with pytest.raises(InvalidArgumentError, match="expected a kvplug KV event"):
        wire_event(("BlockStored",))
    with pytest.raises(InvalidArgumentError, match="timestamp, events, dp_rank"):
        decode_batch(b"\x01")
    assert sequence_number(END_OF_REPLAY) == -1


# ---------------------------------------------------------------------------- the config
def test_config_takes_vllms_and_sglangs_keys():
    config = parse_kv_events_config(json.dumps({
        "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558",
        "topic": "kv", "bind": True, "buffer_steps": 10, "hwm": 20, "max_queue_size": 30,
    }))
    assert config == KVEventsConfig("zmq", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv", True, 10, 20, 30)
    assert parse_kv_events_config("{}") == KVEventsConfig()  # vLLM's defaults: tcp://*:5557, no replay
    assert not parse_kv_events_config('{"enable_kv_cache_events": false}').enabled
    assert not parse_kv_events_config('{"publisher": "null"}').enabled
    assert isinstance(create_publisher(parse_kv_events_config('{"publisher": "null"}')), NullEventPublisher)


@pytest.mark.parametrize("text, named", [
    ('{"endpont": "tcp://127.0.0.1:1"}', "unknown key 'endpont'; accepted keys: publisher, endpoint"),
    ('{"publisher": "kafka"}', "'publisher' must be one of \\['zmq', 'null'\\], got 'kafka'"),
    ('{"endpoint": "127.0.0.1:5557"}', "'endpoint' must be a ZMQ address"),
    ('{"replay_endpoint": 5558}', "'replay_endpoint' must be a ZMQ address"),
    ('{"endpoint": "tcp://h:1", "replay_endpoint": "tcp://h:1"}', "'replay_endpoint' must differ from 'endpoint'"),
    ('{"bind": "yes"}', "'bind' must be true or false"),
    ('{"buffer_steps": 0}', "'buffer_steps' must be an int >= 1, got 0"),
    ('{"hwm": true}', "'hwm' must be an int >= 1, got True"),
    ('{"topic": 3}', "'topic' must be a string"),
    ('{"enable_kv_cache_events": 1}', "'enable_kv_cache_events' must be true or false"),
    ('[1]', "must be a JSON object"),
    ('{"publisher": ', "must be a JSON object"),
])
def test_a_bad_config_names_the_key(text, named):
    with pytest.raises(InvalidArgumentError, match=named):
        parse_kv_events_config(text)


# ---------------------------------------------------------------------------- the publisher
@pytest.fixture
def publisher_at():
    made = []

    def make(**keys):
        first_sequence = keys.pop("first_sequence", None)
        config = KVEventsConfig(endpoint=keys.pop("endpoint", inproc()), **keys)
        publisher = create_publisher(config, first_sequence=first_sequence)
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.close()


def test_subscriber_reads_topic_sequence_and_batch_and_replay_answers_from_a_number(publisher_at):
    replay_endpoint = inproc()
    publisher = publisher_at(topic="kv-events", replay_endpoint=replay_endpoint, first_sequence=1000)
    sub = Subscriber(publisher.config.endpoint)
    try:
        topic, sequence, batch = sub.receive()  # the subscription is answered with an empty batch
        assert (topic, sequence, batch.events, batch.data_parallel_rank) == (b"kv-events", 1000, [], 0)
        for number in range(3):
            assert publisher.publish(EventBatch(50.0 + number, (BlockRemoved((number,)),)))
        got = [sub.receive() for _ in range(3)]
        assert [sequence for _, sequence, _ in got] == [1001, 1002, 1003]
        assert [batch.events[0]["block_hashes"] for _, _, batch in got] == [[0], [1], [2]]
        assert [batch.timestamp for _, _, batch in got] == [50.0, 51.0, 52.0]
        for delimiter in (True, False):  # REQ / DEALER with the delimiter, or a bare DEALER
            answered = replay(replay_endpoint, 1002, delimiter=delimiter)
            assert [sequence for sequence, _ in answered] == [1002, 1003]
            assert answered[0][1] == got[1][2]
        assert replay(replay_endpoint, 5000) == []
        stats = publisher.stats()
        assert (stats.published_batches, stats.published_events, stats.replay_requests) == (4, 3, 3)
        assert (stats.dropped_batches, stats.next_sequence) == (0, 1004)
    finally:
        sub.close()


def test_replay_keeps_the_last_buffer_steps_batches_and_ignores_malformed_requests(publisher_at):
    replay_endpoint = inproc()
    publisher = publisher_at(replay_endpoint=replay_endpoint, buffer_steps=2, first_sequence=0)
    for number in range(5):
        publisher.publish(EventBatch(1.0, (AllCleared(),)))
    deadline = time.monotonic() + 5
    while publisher.stats().published_batches < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [sequence for sequence, _ in replay(replay_endpoint, 0)] == [3, 4]
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    dealer.send_multipart([b"", b"\x01\x02"])  # not 8 bytes
    deadline = time.monotonic() + 5
    while publisher.stats().replay_errors < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    dealer.close(linger=0)
    assert publisher.stats().replay_errors == 1
    assert [sequence for sequence, _ in replay(replay_endpoint, 4)] == [4]  # still answering


def test_sequence_numbers_start_at_the_start_time_in_microseconds(publisher_at):
    before = time.time_ns() // 1000
    publisher = publisher_at()
    after = time.time_ns() // 1000
    assert before <= publisher.stats().next_sequence <= after  # a restarted server never counts from 0 again


def test_a_full_queue_drops_and_counts_and_the_next_batch_clears_the_router(publisher_at):
    publisher = publisher_at(max_queue_size=1, first_sequence=0)
    sub = Subscriber(publisher.config.endpoint)
    try:
        assert sub.receive()[2].events == []
        release, sending = threading.Event(), threading.Event()
        send = publisher._send

        def held_send(pub, batch):  # the publisher thread stalls on the first batch
            sending.set()
            release.wait(10)
            send(pub, batch)

        publisher._send = held_send
        assert publisher.publish(EventBatch(1.0, (BlockRemoved((1,)),)))
        assert sending.wait(5)
        assert publisher.publish(EventBatch(2.0, (BlockRemoved((2,)),)))  # fills the queue
        started = time.monotonic()
        assert not publisher.publish(EventBatch(3.0, (BlockRemoved((3,)), BlockRemoved((4,)))))  # dropped
        assert time.monotonic() - started < 0.5  # publish never waits for the thread
        stats = publisher.stats()
        assert (stats.dropped_batches, stats.dropped_events, stats.queued_batches) == (1, 2, 1)
        publisher._send = send
        release.set()
        deadline = time.monotonic() + 5
        while publisher.stats().published_batches < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # the empty batch of the subscription, then the two queued ones
        assert publisher.publish(EventBatch(4.0, (BlockRemoved((5,)),)))
        got = [sub.receive()[2].events for _ in range(3)]
        assert got[:2] == [[wire_event(BlockRemoved((1,)))], [wire_event(BlockRemoved((2,)))]]
        assert got[2] == [{"type": "AllBlocksCleared"}, wire_event(BlockRemoved((5,)))]
    finally:
        sub.close()


def test_a_batch_that_cannot_be_sent_is_counted_and_the_next_clears_the_router(publisher_at, caplog):
    publisher = publisher_at(first_sequence=0)
    sub = Subscriber(publisher.config.endpoint)
    try:
        assert sub.receive()[2].events == []
        with caplog.at_level("ERROR", logger="kvplug.events"):
            assert publisher.publish(EventBatch(1.0, (BlockStored((1,), None, (object(),), 1),)))  # not encodable
            assert publisher.publish(EventBatch(2.0, (BlockRemoved((2,)),)))
            _, sequence, batch = sub.receive()
        assert sequence == 1 and batch.events == [{"type": "AllBlocksCleared"}, wire_event(BlockRemoved((2,)))]
        deadline = time.monotonic() + 5
        while publisher.stats().published_batches < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # counted just after the send
        stats = publisher.stats()
        assert (stats.dropped_batches, stats.dropped_events, stats.published_batches) == (1, 1, 2)
        assert "could not be published" in caplog.text
    finally:
        sub.close()


def test_an_address_in_use_fails_at_creation_naming_the_key():
    with socket_port() as port:
        endpoint = f"tcp://127.0.0.1:{port}"
        first = create_publisher(KVEventsConfig(endpoint=endpoint))
        try:
            with pytest.raises(KVPlugError, match=f"cannot bind 'endpoint' '{endpoint}'"):
                create_publisher(KVEventsConfig(endpoint=endpoint))
            with pytest.raises(KVPlugError, match=f"cannot bind 'replay_endpoint' '{endpoint}'"):
                create_publisher(KVEventsConfig(endpoint=inproc(), replay_endpoint=endpoint))
        finally:
            first.close()


class socket_port:
    """A free TCP port of 127.0.0.1 (the probe socket is closed before use)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]

    def __exit__(self, *exc) -> None:
        return None


def test_connect_mode_publishes_to_a_bound_subscriber():
    endpoint = inproc()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.bind(endpoint)  # a relay binds; the server connects ("bind": false)
    publisher = create_publisher(KVEventsConfig(endpoint=endpoint, bind=False), first_sequence=7)
    try:
        _, sequence, payload = sub.recv_multipart()
        assert sequence_number(sequence) == 7 and decode_batch(payload).events == []
    finally:
        publisher.close()
        sub.close(linger=0)


# ---------------------------------------------------------------------------- the collector, end to end
class WireRouter:
    """What a router keeps, rebuilt from decoded wire maps only: page hash -> (parent, token ids)."""

    def __init__(self) -> None:
        self.pages: dict[int, tuple] = {}

    def apply(self, events: list) -> None:
        for event in events:
            if event["type"] == "BlockStored":
                parent, size = event["parent_block_hash"], event["block_size"]
                assert parent is None or parent in self.pages
                for number, block_hash in enumerate(event["block_hashes"]):
                    self.pages[block_hash] = (parent, tuple(event["token_ids"][number * size: (number + 1) * size]))
                    parent = block_hash
            elif event["type"] == "BlockRemoved":
                for block_hash in event["block_hashes"]:
                    del self.pages[block_hash]
            else:
                assert event == {"type": "AllBlocksCleared"}
                self.pages.clear()

    def prefixes(self) -> set:
        spelled = set()
        for block_hash in self.pages:
            tokens: list = []
            while block_hash is not None:
                parent, page = self.pages[block_hash]
                tokens[:0] = page
                block_hash = parent
            spelled.add(tuple(tokens))
        return spelled


@pytest.mark.parametrize("seed", range(2))
def test_a_router_reading_the_wire_holds_exactly_the_cached_pages_after_every_step(publisher_at, seed):
    rng = random.Random(seed)
    page_size = 2
    publisher = publisher_at(first_sequence=0)
    sub = Subscriber(publisher.config.endpoint)
    cache = kvplug.create_prefix_cache("radix", page_size=page_size)
    collector = KVEventCollector(publisher)
    router = WireRouter()
    try:
        assert sub.receive()[2].events == []  # subscribed before the first batch
        assert collector.attach(cache)
        next_location, expected = 0, 0
        for step in range(60):
            for _ in range(rng.randrange(1, 4)):  # a step's worth of cache calls
                tokens = [rng.randrange(3) for _ in range(page_size * rng.randrange(1, 5))]
                what = rng.random()
                if what < 0.6:
                    cache.insert_prefix(ids(tokens), ids(range(next_location, next_location + len(tokens))))
                    next_location += len(tokens)
                elif what < 0.95:
                    cache.evict(rng.randrange(cache.size_info.evictable_size + 1))
                else:
                    cache.reset()
            had = collector.pending
            collector.end_step()
            assert collector.pending == 0
            if had:
                _, sequence, batch = sub.receive()
                assert sequence == expected + 1  # one batch per step, numbered in order
                expected = sequence
                router.apply(batch.events)
            assert router.prefixes() == set(radix_prefixes(cache))
            assert set(router.pages) == set(radix_prefixes(cache).values())
    finally:
        sub.close()


def test_attaching_a_cache_clears_the_router_first_and_a_cache_without_events_warns(publisher_at, caplog):
    published = []

    class Recording(NullEventPublisher):
        def publish(self, batch):
            published.append(batch)
            return True

    collector = KVEventCollector(Recording())
    cache = kvplug.create_prefix_cache("radix", page_size=1)
    assert collector.attach(cache)
    cache.insert_prefix(ids([5, 6]), ids([0, 1]))
    collector.end_step()
    collector.end_step()  # nothing new: nothing published
    assert len(published) == 1
    assert published[0].events == (AllCleared(), BlockStored(published[0].events[1].block_hashes, None, (5, 6), 1))

    class Silent(kvplug.BasePrefixCache):  # a version-1 plugin: no events
        def __init__(self):
            pass

        match_prefix = lock_handle = insert_prefix = evict = reset = check_integrity = None
        size_info = None

    with caplog.at_level("WARNING", logger="kvplug.events"):
        assert not collector.attach(Silent())
    assert "reports no KV events" in caplog.text
    collector.detach(cache)
    cache.insert_prefix(ids([7]), ids([2]))
    collector.end_step()
    assert published[-1].events == (AllCleared(),)  # the Silent cache's start, and nothing from the detached one
