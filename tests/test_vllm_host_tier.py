"""kvplug's host-memory tier in vLLM without an engine: the scheduler's recorded copies replayed on a
model of vLLM's blocks and the worker's host pages, against the token ids each block must hold."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test-vllm-host.sh builds its environment)")
pytest.importorskip("kvplug_vllm", reason="kvplug-vllm is not installed (pip install -e adapters/vllm)")

import torch  # noqa: E402

from kvplug.interface import InvalidArgumentError, OutOfMemoryError  # noqa: E402
from kvplug_vllm.block_cache import BlockPrefixCache  # noqa: E402
from kvplug_vllm.connector import host_tier_size, prefix_cache_factory  # noqa: E402
from kvplug_vllm.host_copies import LOAD, SAVE, HostCopy, RecordedHostPool  # noqa: E402
from kvplug_vllm.host_tier import WorkerHostTier  # noqa: E402
from kvplug_vllm.settings import parse_settings  # noqa: E402

BLOCK = 4


@pytest.mark.parametrize("layout", ["2NBHD", "N2BHD", "kernel-halves"])
def test_worker_saves_and_loads_blocks_of_every_layer(layout: str) -> None:
    num_blocks = 10
    shapes = {"2NBHD": (2, num_blocks, BLOCK, 3, 5), "N2BHD": (num_blocks, 2, BLOCK, 3, 5),
              "kernel-halves": (2, num_blocks * 2, BLOCK // 2, 3, 5)}
    caches = {f"layer.{i}": torch.randn(shapes[layout]) for i in range(3)}
    caches["layer.shared"] = caches["layer.0"]  # layers sharing a tensor are copied once
    tier = WorkerHostTier(caches, num_blocks, num_pages=4)
    per = 2 if layout == "kernel-halves" else 1
    dim = 1 if layout != "N2BHD" else 0

    def block(tensor: torch.Tensor, block_id: int) -> torch.Tensor:
        return tensor.narrow(dim, block_id * per, per).clone()

    before = {name: [block(t, b) for b in (3, 7)] for name, t in caches.items()}
    tier.apply([HostCopy(SAVE, (3, 7), (2, 0))])
    for tensor in caches.values():
        tensor.zero_()
    tier.apply([HostCopy(LOAD, (5, 1), (0, 2))])  # page 0 (block 7) -> 5, page 2 (block 3) -> 1
    for name, tensor in caches.items():
        assert torch.equal(block(tensor, 5), before[name][1]) and torch.equal(block(tensor, 1), before[name][0])
        assert not block(tensor, 3).any() and not block(tensor, 7).any()
    assert tier.saved_pages == 2 and tier.loaded_pages == 2
    assert tier.bytes_per_page == 3 * 2 * BLOCK * 3 * 5 * 4


def test_worker_refuses_a_tensor_without_a_block_dimension() -> None:
    with pytest.raises(InvalidArgumentError, match="one leading dimension of 7 blocks"):
        WorkerHostTier({"layer": torch.zeros(2, 3, BLOCK)}, 7, num_pages=1)


def fake_config(page_bytes: int, layers: int = 2) -> SimpleNamespace:
    spec = SimpleNamespace(page_size_bytes=page_bytes)
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(layers)])])


def test_host_memory_is_sized_in_pages_of_every_layer() -> None:
    assert host_tier_size(10 << 20, fake_config(64 << 10)) == (128 << 10, 80)
    with pytest.raises(InvalidArgumentError, match="holds no KV page of 131,072 bytes"):
        host_tier_size(100 << 10, fake_config(64 << 10))
    with pytest.raises(OutOfMemoryError, match="only .* of host memory are available"):
        host_tier_size(1000 << 40, fake_config(64 << 10))


class Model:
    """vLLM's blocks and the worker's host pages, holding the token ids written to them."""

    def __init__(self, num_blocks: int, num_pages: int) -> None:
        self.refs = [0] * num_blocks
        self.blocks: list[tuple[int, ...] | None] = [None] * num_blocks
        self.pages: list[tuple[int, ...] | None] = [None] * num_pages

    def apply(self, copies: tuple[HostCopy, ...]) -> None:
        for copy in copies:
            for block_id, page in zip(copy.block_ids, copy.host_pages):
                if copy.kind == SAVE:
                    self.pages[page] = self.blocks[block_id]
                else:
                    self.blocks[block_id] = self.pages[page]


@pytest.mark.parametrize("seed", range(6))
def test_recorded_copies_bring_back_the_evicted_tokens(seed: int) -> None:
    """Random prompts through a small pool: every host hit, once its copies are replayed, puts the
    prompt's own tokens in the blocks it is loaded into; host pages are conserved across namespaces."""
    rng = random.Random(seed)
    num_blocks, num_pages = 12, 10
    model = Model(num_blocks, num_pages)
    pool = RecordedHostPool(num_pages, BLOCK, bytes_per_page=64)
    settings = parse_settings({"prefix_cache": "radix", "host_memory": 1 << 20})
    factory = prefix_cache_factory(settings, BLOCK, num_blocks, pool)

    def take(ids):
        for i in ids:
            model.refs[i] += 1

    def drop(ids):
        for i in ids:
            model.refs[i] -= 1

    cache = BlockPrefixCache(factory, BLOCK, take, drop)
    heads = [[rng.randrange(50) for _ in range(BLOCK * rng.randint(1, 3))] for _ in range(5)]
    host_hits = 0
    for _ in range(40):
        namespace = rng.choice(("a", "b"))
        tokens = rng.choice(heads) + [rng.randrange(50) for _ in range(BLOCK * rng.randint(0, 1))]
        space = cache.space(namespace)
        found = space.cache.match_tiered(torch.tensor(tokens, dtype=torch.int32))
        device = found.handle.cached_len // BLOCK
        needed = len(tokens) // BLOCK - device
        space.cache.lock_handle(found.host_handle)
        free = [i for i, refs in enumerate(model.refs) if refs == 0]
        if len(free) < needed:
            cache.evict_blocks(needed - len(free))
            model.apply(pool.take_copies())  # the write-backs read the blocks before they are reused
            free = [i for i, refs in enumerate(model.refs) if refs == 0]
        if len(free) < needed:
            space.cache.lock_handle(found.host_handle, unlock=True)
            continue
        own = free[:needed]
        take(own)  # the request's reference
        matched = found.handle.get_matched_indices()[::BLOCK] // BLOCK if device else torch.empty(0)
        block_ids = [int(b) for b in matched] + own
        loaded = found.host_len // BLOCK
        if loaded:
            locations = torch.tensor([b * BLOCK + i for b in own[:loaded] for i in range(BLOCK)], dtype=torch.int32)
            space.cache.load_host_prefix(found.host_handle, locations)
            cache.adopt_loaded(own[:loaded])
            host_hits += 1
        space.cache.lock_handle(found.host_handle, unlock=True)
        model.apply(pool.take_copies())
        for j, block_id in enumerate(own[loaded:], start=device + loaded):  # the forward computes the rest
            model.blocks[block_id] = tuple(tokens[j * BLOCK:(j + 1) * BLOCK])
        for j, block_id in enumerate(block_ids):
            assert model.blocks[block_id] == tuple(tokens[j * BLOCK:(j + 1) * BLOCK])
        cache.insert(namespace, tokens, block_ids)
        drop(own)  # the request finished
        cache.check_integrity()
        assert all(refs >= 0 for refs in model.refs)
        assert sum(refs > 0 for refs in model.refs) == cache.cached_tokens // BLOCK
    assert host_hits > 0
    held = sum(space.cache.host_size_info.evictable_size + space.cache.tier_stats().host_copy_tokens
               for space in cache.spaces()) // BLOCK
    assert held + pool.num_free_pages == num_pages


def test_a_host_pool_is_attached_once_and_of_the_cache_page_size() -> None:
    settings = parse_settings({"prefix_cache": "radix", "host_memory": 1 << 20})
    cache = prefix_cache_factory(settings, BLOCK, 8)()
    with pytest.raises(InvalidArgumentError, match="page_size=4"):
        cache.attach_host_pool(RecordedHostPool(4, BLOCK * 2, 64).share())
    cache.attach_host_pool(RecordedHostPool(4, BLOCK, 64).share())
    with pytest.raises(InvalidArgumentError, match="already has a host pool"):
        cache.attach_host_pool(RecordedHostPool(4, BLOCK, 64).share())
    with pytest.raises(InvalidArgumentError, match=r"takes no options, got \[.host_memory.\]"):
        prefix_cache_factory(parse_settings({"prefix_cache": "naive", "host_memory": 1 << 20}), BLOCK, 8)()
