"""The ``redis`` store against a real ``redis-server`` on 127.0.0.1 (issue 30): the conformance kit,
read-back from another process, password, and a server that is down, slow, full or corrupt."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time

import pytest

import kvplug
import kvplug.testing as kit
from kvplug.kv_store import KVNamespace, RemoteKV, open_remote_kv
from kvplug.kv_store.resp import RespConnection
from tests.redis_server import REDIS_SERVER, SKIP_REASON, free_port, redis_server

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)

NAMESPACE = KVNamespace("tiny-llama", "mha:L2:H2:D8:kv", 4, "bfloat16")
PROMPT = list(range(7, 7 + 4 * 6))
PAGES = [bytes([index]) * 5000 + b"\r\n" for index in range(6)]
MANAGER = kvplug.PluginManager(entry_points=False)


@pytest.fixture(scope="module")
def server():
    with redis_server() as (port, _):
        yield port


def redis(port, **options):
    return MANAGER.create_kv_store(f"redis://127.0.0.1:{port}/0", **options)


@kit.parametrize_kv_store_checks()
def test_redis_store_conforms(server, kv_store_check):
    kv_store_check.run(lambda: redis(server))


def test_databases_are_separate(server):
    writer = RemoteKV(MANAGER.create_kv_store(f"redis://127.0.0.1:{server}/1"), NAMESPACE)
    writer.store_pages(PROMPT, PAGES)
    assert RemoteKV(MANAGER.create_kv_store(f"redis://127.0.0.1:{server}/2"), NAMESPACE).lookup(PROMPT) == 0
    assert RemoteKV(MANAGER.create_kv_store(f"redis://127.0.0.1:{server}/1"), NAMESPACE).lookup(PROMPT) == 6


_WRITER = """
import sys
import kvplug
from kvplug.kv_store import KVNamespace, open_remote_kv
namespace = KVNamespace("tiny-llama", "mha:L2:H2:D8:kv", 4, "bfloat16")
remote = open_remote_kv(sys.argv[1], namespace, manager=kvplug.PluginManager(entry_points=False))
pages = [bytes([index]) * 5000 + b"\\r\\n" for index in range(6)]
assert remote.store_pages(list(range(7, 7 + 4 * 6)), pages) == 6, remote.stats
"""


def test_a_page_written_by_one_process_is_read_back_by_another(server):
    url = f"redis://127.0.0.1:{server}/3"
    subprocess.run([sys.executable, "-c", _WRITER, url], check=True, timeout=60)
    reader = open_remote_kv(url, NAMESPACE, manager=MANAGER)
    assert reader.lookup(PROMPT) == 6
    assert [bytes(page) for page in reader.load(PROMPT, 0, 6)] == PAGES
    assert reader.stats.loaded_pages == 6 and reader.stats.corrupt_pages == 0


def test_password(caplog):
    password = "pa:ss@w/rd"
    quoted = "pa%3Ass%40w%2Frd"
    with redis_server("--requirepass", password) as (port, _):
        good = open_remote_kv(f"redis://:{quoted}@127.0.0.1:{port}/0", NAMESPACE, manager=MANAGER)
        assert good.store_pages(PROMPT, PAGES) == 6 and good.lookup(PROMPT) == 6
        with caplog.at_level(logging.DEBUG, logger="kvplug"):
            for url in (f"redis://:wrong@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):
                refused = open_remote_kv(url, NAMESPACE, manager=MANAGER)
                assert refused.lookup(PROMPT) == 0 and refused.load(PROMPT, 0, 6) == []
                assert refused.stats.errors_auth == 1 and refused.stats.skipped_calls == 1
        assert "127.0.0.1" in caplog.text
        assert password not in caplog.text and quoted not in caplog.text and "wrong" not in caplog.text
        assert quoted not in repr(good.store) and quoted not in good.store.describe()


def test_a_server_that_goes_down_and_comes_back():
    port = free_port()
    with redis_server(port=port) as (_, process):
        remote = open_remote_kv(f"redis://127.0.0.1:{port}/0", NAMESPACE, manager=MANAGER, retry_after_s=0.2)
        assert remote.store_pages(PROMPT, PAGES) == 6
        process.kill()
        process.wait()
        assert remote.lookup(PROMPT) == 0
        assert remote.load(PROMPT, 0, 6) == [] and remote.store_pages(PROMPT, PAGES) == 0
        stats = remote.stats
        assert stats.errors_unavailable == 1 and stats.skipped_calls == 2 and stats.dropped_pages == 6
    with redis_server(port=port):
        time.sleep(0.25)
        assert remote.lookup(PROMPT) == 0  # a fresh server: a miss, and the connection is back
        assert remote.store_pages(PROMPT, PAGES) == 6 and remote.lookup(PROMPT) == 6


def test_a_server_that_never_answers_times_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])  # holds the connection, never replies
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        port = listener.getsockname()[1]
        remote = open_remote_kv(f"redis://127.0.0.1:{port}/0", NAMESPACE, manager=MANAGER, timeout=0.3)
        started = time.monotonic()
        assert remote.lookup(PROMPT) == 0 and remote.store_pages(PROMPT, PAGES) == 0
        assert time.monotonic() - started < 3  # one timeout, then skipped
        assert remote.stats.errors_timeout == 1 and remote.stats.skipped_calls == 1
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        listener.close()


def test_a_full_server_drops_writes_and_counts_them():
    with redis_server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction") as (port, _):
        remote = open_remote_kv(f"redis://127.0.0.1:{port}/0", NAMESPACE, manager=MANAGER)
        big = [bytes([index]) * 1_000_000 for index in range(6)]
        stored = remote.store_pages(PROMPT, big)
        assert 0 < stored < 6
        stats = remote.stats
        assert stats.errors_full == 1 and stats.dropped_pages == 6 - stored and stats.written_pages == stored
        assert remote.lookup(PROMPT) == stored
        assert [bytes(page) for page in remote.load(PROMPT, 0, 6)] == big[:stored]


def test_a_value_corrupted_in_the_server_is_a_counted_miss(server):
    remote = open_remote_kv(f"redis://127.0.0.1:{server}/4", NAMESPACE, manager=MANAGER)
    assert remote.store_pages(PROMPT, PAGES) == 6
    key = remote.keys(PROMPT)[2]
    raw = RespConnection("127.0.0.1", server, timeout=1.0, db=4)
    # SETRANGE flips one byte in place, as a bad disk or a buggy proxy would
    assert raw.pipeline([[b"SETRANGE", key.encode(), b"100", b"\xff"]])[0] > 0
    raw.close()
    assert [bytes(page) for page in remote.load(PROMPT, 0, 6)] == PAGES[:2]
    assert remote.stats.corrupt_pages == 1
    assert remote.store_pages(PROMPT[: 4 * 3], PAGES[:3]) == 3  # recomputed and written again
    assert [bytes(page) for page in remote.load(PROMPT, 0, 6)] == PAGES
