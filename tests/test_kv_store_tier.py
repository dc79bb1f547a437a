"""The shared KV store wired under the host tier (issue 30), end to end: two backends on one
``redis-server``; what the first evicts, the second's admission loads, K/V identical to recompute."""

from __future__ import annotations

import pytest
import torch

import kvplug
from kvplug.memory.model_shape import ModelShape
from tests.redis_server import REDIS_SERVER, SKIP_REASON, redis_server

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 4
PAGE = 4


def fingerprint(tokens: list[int], begin: int, end: int, dtype) -> torch.Tensor:
    """The "recompute": K/V rows ``[2, L, end - begin, H, D]`` of positions ``begin..end-1``, a
    function of every token up to each position."""
    values, value = [], 17
    for position, token in enumerate(tokens[:end]):
        value = (value * 1_000_003 + token + 1) % 8_388_593
        if position >= begin:
            values.append(float(value % 4093))
    rows = torch.tensor(values).view(1, 1, -1, 1, 1)
    offsets = torch.arange(2 * LAYERS * KV_HEADS * HEAD_DIM, dtype=torch.float32).view(2, LAYERS, 1, KV_HEADS, HEAD_DIM)
    return (rows + offsets / 64).to(dtype)


class Server:
    """One backend (memory only, no attention) whose "forward" writes the fingerprints."""

    def __init__(self, url, *, model="tiny", dtype=torch.float32, num_pages=8, host_pages=16, options=None,
                 device="cpu"):
        shape = ModelShape(LAYERS, 2, KV_HEADS, HEAD_DIM, dtype)
        self.dtype = dtype
        self.backend = kvplug.create_backend(
            shape, page_size=PAGE, num_pages=num_pages, max_running_reqs=4, max_seq_len=16 * PAGE, attention=None,
            prefix_cache="radix", device=device,
            prefix_cache_options={"host_memory": host_pages * shape.kv_bytes_per_token() * PAGE, "remote_kv": url,
                                  "remote_kv_model": model, **(options or {})},
        )
        self.rows = self.backend.pool.kv_buffer.view(2, LAYERS, -1, KV_HEADS, HEAD_DIM)
        self.cache = self.backend.prefix_cache

    def serve(self, tokens):
        """Admit, check what was matched against the recompute, compute the rest, finish; the matched length."""
        request = self.backend.admit(tokens)
        matched = request.matched_len
        if self.rows.is_cuda:
            torch.cuda.synchronize()  # the test reads the pages: the host tier's loads must be done
        locations = self.backend.page_table[request.row, :matched].long()
        expected = fingerprint(tokens, 0, matched, self.dtype).to(self.rows.device)
        assert torch.equal(self.rows[:, :, locations], expected), (
            f"{matched} matched tokens hold K/V other than the recompute's"
        )
        self.backend.allocate([request])
        cached, length = request.cached_len, request.device_len
        out = self.backend.page_table[request.row, cached:length].long()
        self.rows[:, :, out] = fingerprint(tokens, cached, length, self.dtype).to(self.rows.device)
        self.backend.finish(request, computed=True)
        self.backend.check_integrity()
        return matched


PROMPT = [5 + index % 11 for index in range(6 * PAGE + 1)]


pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_second_server_loads_the_first_ones_prefix_from_the_store(dtype):
    with redis_server() as (port, _):
        url = f"redis://127.0.0.1:{port}/0"
        first, second = Server(url, dtype=dtype), Server(url, dtype=dtype)
        assert first.serve(PROMPT) == 0
        first.backend.evict_prefix_cache(6 * PAGE)  # to host memory, and through to the store
        assert first.cache.remote_kv.stats.written_pages == 6
        matched = second.serve(PROMPT)
        assert matched == 6 * PAGE, "the second server recomputed a prefix the store holds"
        stats = second.cache.remote_kv.stats
        assert stats.loaded_pages == 6 and stats.corrupt_pages == 0
        tier = second.cache.tier_stats()
        assert tier.loads == 1 and tier.remote_hit_tokens == 6 * PAGE  # loaded through its own host tier
        assert first.cache.tier_stats().remote_written_pages == 6
        # a longer prompt sharing the prefix: the store's part, then the first server's own
        longer = PROMPT[:-1] + [99] * (2 * PAGE)
        assert Server(url, dtype=dtype).serve(longer) == 6 * PAGE


def test_another_model_or_a_dead_store_is_a_recompute():
    with redis_server() as (port, process):
        url = f"redis://127.0.0.1:{port}/0"
        first = Server(url)
        first.serve(PROMPT)
        first.backend.evict_prefix_cache(6 * PAGE)
        assert Server(url, model="another-model").serve(PROMPT) == 0
        process.kill()
        process.wait()
        survivor = Server(url)
        assert survivor.serve(PROMPT) == 0  # down: a miss, no exception
        assert survivor.cache.remote_kv.stats.errors_unavailable == 1
        assert first.serve(PROMPT) == 6 * PAGE  # the first server still serves from its host tier
        other = [40 + index % 7 for index in range(4 * PAGE + 1)]
        assert first.serve(other) == 0  # its lookup fails: a miss
        first.backend.evict_prefix_cache(first.cache.size_info.evictable_size)  # a write-back to a dead store: dropped, counted
        stats = first.cache.remote_kv.stats
        assert stats.dropped_pages == 4 and stats.errors_unavailable + stats.skipped_calls >= 2
        first.backend.check_integrity()


def test_a_value_corrupted_in_the_store_is_recomputed():
    from kvplug.kv_store.resp import RespConnection

    with redis_server() as (port, _):
        url = f"redis://127.0.0.1:{port}/0"
        first = Server(url)
        first.serve(PROMPT)
        first.backend.evict_prefix_cache(6 * PAGE)
        key = first.cache.remote_kv.keys(PROMPT)[3]
        connection = RespConnection("127.0.0.1", port, timeout=1.0)
        connection.pipeline([[b"SETRANGE", key.encode(), b"40", b"\x00\x01"]])
        connection.close()
        second = Server(url)
        assert second.serve(PROMPT) == 3 * PAGE  # the intact pages before the corrupt one
        assert second.cache.remote_kv.stats.corrupt_pages == 1


def test_remote_kv_options_are_validated():
    with pytest.raises(kvplug.InvalidArgumentError, match="remote_kv_model"):
        kvplug.create_prefix_cache("radix", page_size=PAGE, host_memory=1 << 20, remote_kv="redis://127.0.0.1:1/0")
    with pytest.raises(kvplug.InvalidArgumentError, match="host_memory"):
        kvplug.create_prefix_cache("radix", page_size=PAGE, remote_kv="redis://127.0.0.1:1/0", remote_kv_model="m")
    with pytest.raises(kvplug.UnknownComponentError):
        kvplug.create_prefix_cache("radix", page_size=PAGE, host_memory=1 << 20, remote_kv="nope://x", remote_kv_model="m")
