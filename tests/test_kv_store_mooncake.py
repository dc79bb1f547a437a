"""The ``mooncake`` store against a real Mooncake Store on 127.0.0.1 (issue 30): the conformance kit,
read-back from another process, batches split to the staging buffer, a full store, and a master
that is down or dies mid-run (a fast, counted miss, never a stall)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import kvplug
import kvplug.testing as kit
from kvplug.interface import InvalidArgumentError
from kvplug.kv_store import KVNamespace, open_remote_kv
from tests.mooncake_server import INSTALLED, SKIP_REASON, mooncake_cluster
from tests.redis_server import free_port

pytestmark = pytest.mark.skipif(not INSTALLED, reason=SKIP_REASON)

NAMESPACE = KVNamespace("tiny-llama", "mha:L2:H2:D8:kv", 4, "bfloat16")
PROMPT = list(range(7, 7 + 4 * 6))
PAGES = [bytes([index]) * 5000 + b"\r\n" for index in range(6)]
MANAGER = kvplug.PluginManager(entry_points=False)


def ready(cluster, **options):
    return MANAGER.create_kv_store(cluster.url, **options)  # mooncake_cluster waited until it takes pages


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with mooncake_cluster(tmp_path_factory.mktemp("mooncake")) as running:
        yield running


@kit.parametrize_kv_store_checks()
def test_mooncake_store_conforms(cluster, kv_store_check):
    kv_store_check.run(lambda: MANAGER.create_kv_store(cluster.url))


_WRITER = """
import sys
import kvplug
from kvplug.kv_store import KVNamespace, open_remote_kv
namespace = KVNamespace("tiny-llama", "mha:L2:H2:D8:kv", 4, "bfloat16")
remote = open_remote_kv(sys.argv[1], namespace, manager=kvplug.PluginManager(entry_points=False))
pages = [bytes([index]) * 5000 + b"\\r\\n" for index in range(6)]
assert remote.store_pages(list(range(7, 7 + 4 * 6)), pages) == 6, remote.stats
remote.close()
"""


def test_a_page_written_by_one_process_is_read_back_by_another(cluster):
    subprocess.run([sys.executable, "-c", _WRITER, cluster.url], check=True, timeout=120)  # the writer has exited
    reader = open_remote_kv(cluster.url, NAMESPACE, manager=MANAGER)
    assert reader.lookup(PROMPT) == 6
    assert [bytes(page) for page in reader.load(PROMPT, 0, 6)] == PAGES
    assert reader.stats.loaded_pages == 6 and reader.stats.corrupt_pages == 0 and reader.stats.errors_unavailable == reader.stats.errors_other == 0


def test_batches_larger_than_the_staging_buffer_are_split(cluster):
    store = MANAGER.create_kv_store(cluster.url, local_buffer_size=1 << 20)
    keys = [f"split-{time.monotonic_ns()}-{index}" for index in range(5)]
    pages = [bytes([index]) * (400 << 10) for index in range(5)]  # 2 MB in all through a 1 MiB buffer
    assert store.put(keys, pages) == 5 and store.exists(keys) == 5
    reader = MANAGER.create_kv_store(cluster.url, local_buffer_size=1 << 20)  # learns the page size itself
    assert reader.get(keys) == pages
    too_big = [f"big-{time.monotonic_ns()}"]
    assert store.put(too_big, [b"x" * (2 << 20)]) == 0  # one page beyond the buffer is dropped, not an error
    assert store.exists(too_big) == 0


def test_a_full_store_keeps_what_fits_and_drops_the_rest(tmp_path):
    with mooncake_cluster(tmp_path, segment="64MB") as small:
        store = ready(small, local_buffer_size=32 << 20)
        keys = [f"full-{index}" for index in range(12)]
        stored = store.put(keys, [bytes([index]) * (8 << 20) for index in range(12)])  # 96 MB into 64
        assert 0 < stored < 12
        assert store.exists(keys) == stored  # what put reported is exactly the stored prefix
        assert store.get(keys[:stored]) == [bytes([index]) * (8 << 20) for index in range(stored)]


def test_url_and_options_are_checked():
    for url, match in [("mooncake://127.0.0.1", "MASTER_HOST:PORT"), ("mooncake://127.0.0.1:1/x", "no path"),
                       ("mooncake://u:pw@127.0.0.1:1", "no path or credential"),
                       ("mooncake://127.0.0.1:1?colour=red", "unknown Mooncake option"),
                       ("mooncake://127.0.0.1:1?local_buffer_size=0", "positive")]:
        with pytest.raises(InvalidArgumentError, match=match) as error:
            MANAGER.create_kv_store(url)
        assert "pw" not in str(error.value)


def test_a_master_that_is_down_is_a_fast_counted_miss():
    url = f"mooncake://127.0.0.1:{free_port()}"  # nothing listens there
    remote = open_remote_kv(url, NAMESPACE, manager=MANAGER, retry_after_s=0)
    started = time.monotonic()
    assert remote.lookup(PROMPT) == 0 and remote.store_pages(PROMPT, PAGES) == 0 and remote.load(PROMPT, 0, 6) == []
    assert time.monotonic() - started < 5  # Mooncake's own setup would block ~90 s
    assert remote.stats.errors_unavailable == 3


def test_a_master_killed_mid_run_is_a_fast_counted_miss(tmp_path):
    with mooncake_cluster(tmp_path) as doomed:
        remote = open_remote_kv(doomed.url, NAMESPACE, manager=MANAGER, retry_after_s=0)
        assert remote.store_pages(PROMPT, PAGES) == 6 and remote.lookup(PROMPT) == 6
        doomed.kill_master()
        started = time.monotonic()
        assert remote.lookup(PROMPT) == 0 and remote.load(PROMPT, 0, 6) == []
        assert remote.store_pages(PROMPT + [1] * 4, PAGES + PAGES[:1]) == 0
        assert time.monotonic() - started < 5  # without the probe each of these took 4-13 s
        assert remote.stats.errors_unavailable == 3 and remote.stats.corrupt_pages == 0
