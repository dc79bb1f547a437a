"""A restarted KV-event publisher behind Dynamo's indexer, without an SGLang server (issue 27): run by
``tests/test_dynamo_sglang_fleet.py`` in the SGLang environment, it prints one JSON line.

SGLang's ``ZmqEventPublisher`` class (``sglang``: as a native server builds it, numbered from the
start time as kvplug-sglang numbers it) or kvplug-sglang's ``AnsweringZmqEventPublisher``
(``kvplug``) publishes a page to the indexer, goes away for ``DOWN_S`` (long enough for the
indexer's SUB socket to back off to its longest reconnect interval), comes back on the same
addresses and publishes its ``AllBlocksCleared`` at once, as a starting server does, then nothing.
It reports when the indexer dropped the old page, if it did within ``WAIT_S``.
  usage: python tests/sglang_restart_probe.py sglang|kvplug INDEXER_URL EVENTS_ENDPOINT REPLAY_ENDPOINT
"""

from __future__ import annotations

import itertools
import json
import sys
import time
import urllib.request

DOWN_S = 12.0  # Dynamo's SUB backs off 100 ms, doubling, to 5 s: reached after about 6 s
WAIT_S = 15.0  # past the longest interval: a reconnected indexer has seen the new run by then
TOKENS = list(range(1, 33))  # two pages of 16


def scores(indexer: str) -> dict:
    body = json.dumps({"token_ids": TOKENS, "model_name": "probe"}).encode()
    request = urllib.request.Request(f"{indexer}/query", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return {worker: ranks.get("0") for worker, ranks in json.loads(response.read())["scores"].items() if ranks.get("0")}


def wait(indexer: str, expected, limit_s: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if expected(scores(indexer)):
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def main(kind: str, indexer: str, endpoint: str, replay_endpoint: str) -> dict:
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockStored, KVEventBatch, ZmqEventPublisher

    from kvplug_sglang.answering_publisher import AnsweringZmqEventPublisher

    def start():
        config = {"endpoint": endpoint, "replay_endpoint": replay_endpoint, "bind": True}
        if kind == "kvplug":
            return AnsweringZmqEventPublisher(attn_dp_rank=0, **config)
        publisher = ZmqEventPublisher(attn_dp_rank=0, **config)
        publisher._seq_gen = itertools.count(time.time_ns() // 1000)
        return publisher

    publisher = start()
    publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
    stored = BlockStored(block_hashes=[101, 102], parent_block_hash=None, token_ids=TOKENS, block_size=16, lora_id=None)
    deadline = time.monotonic() + 20
    while not scores(indexer) and time.monotonic() < deadline:  # the indexer's first connect
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored]))
        time.sleep(0.5)
    before = scores(indexer)
    publisher.shutdown()
    time.sleep(DOWN_S)
    publisher = start()
    publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
    try:
        cleared = wait(indexer, lambda s: not s, WAIT_S)
    finally:
        publisher.shutdown()
    return {"before": before, "cleared_after_s": cleared}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])), flush=True)
