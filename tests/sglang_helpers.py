"""Shared by ``test_sglang_host.py``: importing SGLang 0.5.23 on a CPU machine, SGLang-shaped worlds
(its own req-to-token pool, allocator and requests) to drive a prefix cache through, and an
attention world (kvplug's pools in SGLang's classes, SGLang ``ForwardBatch``es over them).

``import_sglang()`` skips the caller when SGLang or kvplug-sglang is missing or SGLang is not the
supported version. The environment is SGLang's own pins (``scripts/test-sglang-host.sh``): torch
2.14.1 with its torchvision 0.29.1, which SGLang's config package imports at module level.
"""

from __future__ import annotations

import importlib.util
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch


def import_sglang() -> str:
    """Make SGLang importable here, or skip the calling module when SGLang or kvplug-sglang is not
    installed (or SGLang is not the supported version); returns SGLang's version. An installed
    SGLang whose imports fail (a missing dependency) is an error, not a skip."""
    if importlib.util.find_spec("sglang") is None:
        pytest.importorskip("sglang", reason="SGLang is not installed: pip install --no-deps sglang==0.5.23 (README)")
    if importlib.util.find_spec("kvplug_sglang") is None:
        pytest.importorskip("kvplug_sglang", reason="kvplug-sglang is not installed: pip install -e adapters/sglang")
    from kvplug_sglang import compat

    version = compat.installed_sglang_version()
    if not compat.is_supported(version):
        pytest.skip(f"kvplug-sglang supports SGLang {compat.SUPPORTED_VERSIONS}, found {version}")
    return version


# ---------------------------------------------------------------------------- SGLang worlds


@dataclass
class World:
    """One SGLang serving state: a tree cache over its own pools (built as SGLang's unit tests do)."""

    cache: Any
    allocator: Any
    table: Any
    page_size: int
    requests: dict[str, Any] = field(default_factory=dict)

    def free_locations(self) -> list[int]:
        """Every location the allocator can hand out now, sorted (pages expanded to tokens)."""
        pages = self.allocator.get_all_free_pages()
        if self.page_size == 1:
            return sorted(pages.tolist())
        offsets = torch.arange(self.page_size)
        return sorted((pages[:, None] * self.page_size + offsets).reshape(-1).tolist())


def make_pools(*, size: int, page_size: int, max_requests: int, max_context: int):
    """SGLang's ``ReqToTokenPool`` and token allocator (page 1) or paged allocator, on the CPU."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    table = ReqToTokenPool(size=max_requests, max_context_len=max_context, device="cpu", enable_memory_saver=False)
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(size, torch.float32, "cpu", None, need_sort=True)
    else:
        allocator = PagedTokenToKVPoolAllocator(size, page_size, torch.float32, "cpu", None, need_sort=True)
    return table, allocator


def cache_params(table: Any, allocator: Any, page_size: int, **overrides: Any) -> Any:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    return CacheInitParams(
        disable=overrides.pop("disable", False),
        req_to_token_pool=table,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        **overrides,
    )


def admit(world: World, rid: str, prompt: list[int], output: list[int]) -> Any:
    """What the scheduler does for a new request: match (``init_next_round_input``), lock the match
    (``PrefillAdder``), take a row and token slots, evicting through the tree cache when short
    (``alloc_token_slots``), and write the row. The whole request (prompt and output) is allocated
    up front; ``output`` becomes its output ids."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocation import alloc_token_slots
    from sglang.srt.sampling.sampling_params import SamplingParams

    cache, table, page = world.cache, world.table, world.page_size
    req = Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", prompt),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=len(output) + 1),
    )
    req.init_next_round_input(cache)
    req.lock = cache.lock(req.last_node)
    prefix = cache.prefix_device_indices(req) if req.prefix_len else torch.empty(0, dtype=torch.int64)
    table.alloc([req])
    total = len(prompt) + len(output)
    new_tokens = total - req.prefix_len
    slots = alloc_token_slots(cache, -(-new_tokens // page) * page)[:new_tokens]
    table.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix)
    table.write((req.kv.req_pool_idx, slice(req.prefix_len, total)), slots)
    req.output_ids = array("q", output)
    req.refresh_fill_ids()
    req.extend_end = total
    req.kv.kv_committed_len = req.kv.kv_allocated_len = total
    world.requests[rid] = req
    return req


def checkpoint(world: World, rid: str) -> None:
    """A running request publishes what it computed so far (SGLang's ``checkpoint_kv_cache``)."""
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    checkpoint_kv_cache(world.requests[rid], world.cache)


def finish(world: World, rid: str) -> None:
    """The request finishes and its KV goes to the tree (SGLang's ``release_kv_cache``)."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    req = world.requests.pop(rid)
    req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
    release_kv_cache(req, world.cache, checkpoint=True)


def build_context(params: Any, **flags: Any) -> Any:
    """SGLang's ``TreeCacheBuildContext`` for a CPU world without a model."""
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    defaults = dict(is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False, disable_radix_cache=False)
    defaults.update(flags)
    return TreeCacheBuildContext(
        server_args=None, params=params, tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None,
        **defaults,
    )


def make_world(
    kind: str, *, page_size: int, size: int = 96, max_requests: int = 6, max_context: int = 64, **params: Any
) -> World:
    """``kind`` ``"sglang"``: SGLang's ``RadixCache``; else kvplug prefix cache ``kind`` behind the
    adapter. ``params``: ``CacheInitParams`` fields (e.g. ``enable_kv_cache_events=True``)."""
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    from kvplug_sglang import names

    table, allocator = make_pools(size=size, page_size=page_size, max_requests=max_requests, max_context=max_context)
    params = cache_params(table, allocator, page_size, **params)
    if kind == "sglang":
        cache = RadixCache(params)
    else:  # through the factory SGLang's create_tree_cache calls for --radix-cache-backend kvplug:NAME
        cache = get_radix_cache_factory(names.radix_cache_backend_name(kind))(build_context(params))
    return World(cache, allocator, table, page_size)


def assert_same_state(reference: World, candidate: World, step: str) -> None:
    """Same evictable and protected sizes, free locations, and in-flight requests' matches and rows."""
    assert candidate.cache.evictable_size() == reference.cache.evictable_size(), step
    assert candidate.cache.protected_size() == reference.cache.protected_size(), step
    assert candidate.free_locations() == reference.free_locations(), step
    for rid, req in reference.requests.items():
        other = candidate.requests[rid]
        assert (other.prefix_len, other.kv.cache_protected_len) == (req.prefix_len, req.kv.cache_protected_len), step
        rows = (world.table.req_to_token[r.kv.req_pool_idx, : r.extend_end] for world, r in ((reference, req), (candidate, other)))
        assert torch.equal(*rows), step


EVICT_ALL = 1 << 30  # SGLang evicts what it can: every unlocked entry


def apply(world: World, operation: tuple[str, Any]) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    kind, argument = operation
    if kind == "admit":
        admit(world, *argument)
    elif kind == "checkpoint":
        checkpoint(world, argument)
    elif kind == "finish":
        finish(world, argument)
    else:
        world.cache.evict(EvictParams(num_tokens=argument))


def run_both(page_size: int, operations, **pools) -> tuple[World, World]:
    """Apply ``operations`` to SGLang's RadixCache and to kvplug's radix cache behind the adapter,
    comparing the two after every step."""
    reference, candidate = make_world("sglang", page_size=page_size, **pools), make_world("radix", page_size=page_size, **pools)
    for step, operation in enumerate(operations):
        apply(reference, operation)
        apply(candidate, operation)
        assert_same_state(reference, candidate, f"step {step}: {operation}")
    return reference, candidate


def page_tokens(page_size: int, *page_ids: int) -> list[int]:
    """Whole pages of distinct token ids: page ``p`` holds ``10 * p .. 10 * p + page_size - 1``."""
    return [10 * page + offset for page in page_ids for offset in range(page_size)]


# ---------------------------------------------------------------------------- attention worlds

Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 8, 2


class AttentionWorld:
    """kvplug's pools built as SGLang's ``KVCacheConfigurator`` builds them (through the hooks'
    classes), SGLang's allocator over them, and a dense copy of every request's K/V."""

    def __init__(self, page_size: int, seed: int) -> None:
        from sglang.srt.layers.radix_attention import RadixAttention

        from kvplug_sglang.pools import KvplugMHATokenToKVPool, KvplugReqToTokenPool

        self.page_size = page_size
        self.generator = torch.Generator().manual_seed(seed)
        self.table = KvplugReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
        self.kv = KvplugMHATokenToKVPool(
            size=64 * page_size, page_size=page_size, dtype=torch.float32, head_num=KV_HEADS, head_dim=HEAD_DIM,
            layer_num=LAYERS, device="cpu", enable_memory_saver=False,
        )
        self.allocator = make_pools(size=64 * page_size, page_size=page_size, max_requests=1, max_context=1)[1]
        self.runner = SimpleNamespace(device="cpu", req_to_token_pool=self.table, token_to_kv_pool=self.kv)
        self.layers = [RadixAttention(Q_HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, layer) for layer in range(LAYERS)]
        self.rows: list[int] = []
        self.lens: list[int] = []
        self.dense: dict[tuple[int, int], list[torch.Tensor]] = {}  # (request, layer) -> [k, v]

    def random(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator)

    def add_requests(self, cached_lens: list[int]) -> None:
        """New requests whose first ``cached_lens[i]`` tokens' K/V are already in the pool (a prefix hit)."""
        for cached in cached_lens:
            self.rows.append(self.table.alloc_rows(1)[0])
            self.lens.append(0)
            for layer in range(LAYERS):
                self.dense[(len(self.rows) - 1, layer)] = [self.random(0, KV_HEADS, HEAD_DIM)] * 2
            if cached:
                self.grow({len(self.rows) - 1: cached}, store=True)

    def grow(self, extend: dict[int, int], store: bool = False) -> torch.Tensor:
        """Allocate locations for ``extend[i]`` more tokens of request ``i`` (pages scattered over the
        pool); with ``store`` also write random K/V there. Returns the new tokens' locations."""
        new_locations = []
        for request, count in extend.items():
            row, start = self.rows[request], self.lens[request]
            locations = self.table.req_to_token[row, :start].tolist()
            while len(locations) < start + count:
                if len(locations) % self.page_size == 0:  # a fresh page: take one from the middle of the free list
                    free = self.allocator.free_pages
                    page = int(free[len(free) // 2])
                    self.allocator.free_pages = free[free != page]
                    locations += range(page * self.page_size, page * self.page_size + self.page_size)
                    del locations[start + count :]
                else:
                    locations.append(locations[-1] + 1)
            self.table.write((row, slice(start, start + count)), torch.tensor(locations[start:]))
            self.lens[request] += count
            new_locations += locations[start:]
        out = torch.tensor(new_locations, dtype=torch.int64)
        if store:
            self.store(extend, out, [(self.random(len(out), KV_HEADS, HEAD_DIM), self.random(len(out), KV_HEADS, HEAD_DIM)) for _ in range(LAYERS)])
        return out

    def store(self, extend: dict[int, int], locations: torch.Tensor, kv_per_layer) -> None:
        """Write K/V through SGLang's own pool API and keep the dense copy."""
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        for layer, (k, v) in enumerate(kv_per_layer):
            self.kv.set_kv_buffer(self.layers[layer], KVWriteLoc(locations, None), k, v)
            self.append_dense(extend, layer, k, v)

    def append_dense(self, extend: dict[int, int], layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        start = 0
        for request, count in extend.items():
            dense = self.dense[(request, layer)]
            dense[0] = torch.cat([dense[0], k[start : start + count]])
            dense[1] = torch.cat([dense[1], v[start : start + count]])
            start += count

    def forward_batch(self, mode: Any, extend: dict[int, int]) -> Any:
        """Grow the requests in ``extend`` and describe the step as SGLang's model runner does
        (an SGLang ``ForwardBatch`` in ``mode``)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        cached = [self.lens[request] for request in extend]
        out_cache_loc = self.grow(extend)
        seq_lens = torch.tensor([self.lens[request] for request in extend])
        extend_lens = seq_lens - torch.tensor(cached)
        rows = torch.tensor([self.rows[request] for request in extend])
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(extend),
            input_ids=torch.zeros(len(out_cache_loc), dtype=torch.int64),
            req_pool_indices=rows,
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            seq_lens_sum=int(seq_lens.sum()),
            seq_lens_cpu=seq_lens.clone(),
            req_pool_indices_cpu=rows.clone(),
            extend_prefix_lens=torch.tensor(cached),
            extend_prefix_lens_cpu=list(cached),
            extend_seq_lens=extend_lens,
            extend_seq_lens_cpu=extend_lens.tolist(),
            extend_num_tokens=len(out_cache_loc),
            positions=torch.cat([torch.arange(c, s) for c, s in zip(cached, seq_lens.tolist())]),
        )
