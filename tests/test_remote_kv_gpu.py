"""The shared KV store under a CUDA pool's host tier (issue 30), against a real ``redis-server``: the
store writer stores what eviction copied once the copy has landed (never waiting on the serving
thread), and a second CUDA backend's admission loads it through its host tier with K/V identical
to the recompute, also when host pages are reused while writes are queued. Skipped without CUDA or
without ``redis-server``; the no-host-wait check with a store is in ``test_no_host_wait_gpu``."""

from __future__ import annotations

import pytest
import torch

from tests.attention_reference import requires_cuda
from tests.redis_server import REDIS_SERVER, SKIP_REASON, redis_server
from tests.test_kv_store_tier import PAGE, PROMPT, Server

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)]

FLUSH_S = 30.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cuda_backend_loads_another_ones_prefix_from_redis_identical_to_recompute(dtype):
    with redis_server() as (port, _):
        url = f"redis://127.0.0.1:{port}/0"
        first = Server(url, dtype=dtype, device="cuda")
        assert first.cache._host_tier.remote.writer.threaded, "a CUDA pool writes on the writer thread"
        assert first.serve(PROMPT) == 0
        first.backend.evict_prefix_cache(6 * PAGE)  # queued: the device -> host copy, then the store write
        assert first.cache.flush_remote_kv(FLUSH_S)
        stats = first.cache.remote_kv.stats
        assert (stats.queued_pages, stats.written_pages, stats.unwritten_pages, stats.dropped_pages) == (6, 6, 0, 0)
        second = Server(url, dtype=dtype, device="cuda")
        assert second.serve(PROMPT) == 6 * PAGE, "the second server recomputed a prefix the store holds"
        tier = second.cache.tier_stats()
        assert tier.remote_hit_tokens == 6 * PAGE and tier.loads == 1 and tier.remote_corrupt_pages == 0
        longer = PROMPT[:-1] + [99] * (2 * PAGE)  # the store's pages, then the rest recomputed
        assert Server(url, dtype=dtype, device="cuda").serve(longer) == 6 * PAGE


def test_host_pages_reused_while_writes_are_queued_store_only_exact_bytes():
    """A small host tier on CUDA, prefixes evicted back to back (host pages dropped and reused
    while their writes are queued): every page the store holds loads as the recompute."""
    prompts = [[base + index % (5 + base % 7) for index in range(pages * PAGE + 1)]
               for base, pages in ((3, 6), (40, 3), (70, 5), (90, 2), (120, 4), (150, 6))]
    with redis_server() as (port, _):
        url = f"redis://127.0.0.1:{port}/0"
        first = Server(url, device="cuda", host_pages=8)
        for _ in range(3):
            for prompt in prompts:
                first.serve(prompt)
                first.backend.evict_prefix_cache(first.cache.size_info.evictable_size)
                first.backend.check_integrity()
        for prompt in prompts:  # once more, each write done before the next eviction: all of them stored
            first.serve(prompt)
            first.backend.evict_prefix_cache(first.cache.size_info.evictable_size)
            assert first.cache.flush_remote_kv(FLUSH_S)
        stats = first.cache.remote_kv.stats
        assert stats.written_pages > 0 and stats.errors_other == 0
        assert stats.queued_pages == stats.written_pages + stats.unwritten_pages + stats.dropped_pages
        hits = 0
        for prompt in prompts:  # identity checked inside serve
            hits += Server(url, device="cuda").serve(prompt) > 0
        assert hits == len(prompts), "a prefix written to the store did not load back"
        first.backend.check_integrity()
        assert first.cache.close_remote_kv()
