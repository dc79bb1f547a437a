"""Reading a server's KV events in tests as a router does: a SUB socket and vLLM's replay protocol."""

from __future__ import annotations

import pytest

from kvplug.events.wire import decode_batch, sequence_number

zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed: pip install -e '.[events]'")
pytest.importorskip("msgpack", reason="the events extra (msgpack) is not installed: pip install -e '.[events]'")


class Subscriber:
    """A SUB socket reading whole messages: (topic, sequence number, decoded batch)."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(endpoint)

    def receive(self):
        topic, sequence, payload = self.sock.recv_multipart()
        return topic, sequence_number(sequence), decode_batch(payload)

    def close(self) -> None:
        self.sock.close(linger=0)


def replay(endpoint: str, start: int, *, delimiter: bool = True) -> list:
    """vLLM's replay protocol from a DEALER: every (sequence, batch) answered until the end marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")] if delimiter else [start.to_bytes(8, "big")])
        answered = []
        while True:
            frames = dealer.recv_multipart()
            if delimiter:
                assert frames[0] == b""
                frames = frames[1:]
            _, sequence, payload = frames
            if sequence_number(sequence) == -1:
                assert payload == b""
                return answered
            answered.append((sequence_number(sequence), decode_batch(payload)))
    finally:
        dealer.close(linger=0)
