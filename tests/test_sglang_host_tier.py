"""kvplug's host-memory tier under SGLang 0.5.23's tree cache (``--kvplug-host-memory``), on the CPU.

Through SGLang's own objects (its ``ReqToTokenPool``, token allocators over kvplug's KV pool
``KvplugMHATokenToKVPool``, ``Req`` and lifecycle helpers) and the calls SGLang's ``PrefillAdder``
makes on admission (match, lock the device head, ``init_load_back``, lock the whole match):

- evicting writes the evicted prefixes back to host memory and gives every device location back
  to SGLang's allocator; a later request that matches them gets them loaded into locations taken
  from that allocator, with K/V bit-identical to what was evicted, and SGLang only ever reads
  device locations;
- locations are conserved (allocator + tree + requests) and the tree passes its integrity check;
- an allocator with no room falls back to the device head (nothing loaded, nothing leaked);
- KV events report the tier's medium the way SGLang names it (``GPU`` / ``CPU_PINNED``);
- the flag's errors, and its way to the scheduler through ``--radix-cache-backend``.
"""

from __future__ import annotations

from array import array

import pytest
import torch

from tests.sglang_helpers import EVICT_ALL, World, build_context, cache_params, finish, import_sglang, make_pools

SGLANG_VERSION = import_sglang()

from kvplug.interface import KV_MEDIUM_HOST  # noqa: E402
from kvplug_sglang import names  # noqa: E402
from kvplug_sglang.pools import KvplugMHATokenToKVPool  # noqa: E402
from kvplug_sglang.radix_backends import build_prefix_cache  # noqa: E402
from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, StorageMedium  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.registry import get_radix_cache_factory  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args, set_global_server_args_for_scheduler  # noqa: E402

LAYERS, HEADS, DIM = 2, 2, 4
HOST_MEMORY = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def sglang_with_plugins():
    load_plugins()
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))


class TierWorld(World):
    """An SGLang world whose allocator hands out locations of a kvplug KV pool, with a host tier."""

    kv: KvplugMHATokenToKVPool

    def tokens(self) -> torch.Tensor:
        """The pool by token location: ``[2, layers, locations, heads, dim]``, float32, cpu (a view)."""
        return self.kv.kvplug_pool.kv_buffer.view(2, LAYERS, -1, HEADS, DIM)

    def total(self) -> int:
        return self.allocator.size

    def accounted(self) -> int:
        """Locations the allocator can hand out plus those the tree holds on the device."""
        return self.allocator.available_size() + self.cache.evictable_size() + self.cache.protected_size()


def tier_world(page_size: int, *, size: int = 64, host_memory: int = HOST_MEMORY, events: bool = False,
               name: str = "radix", manager=None) -> TierWorld:
    """``manager``: builds the cache ``name`` (default: kvplug's default manager)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    kv = KvplugMHATokenToKVPool(
        size=size, page_size=page_size, dtype=torch.float32, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
        device="cpu", enable_memory_saver=False,
    )
    table, _ = make_pools(size=size, page_size=page_size, max_requests=6, max_context=64)
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(size, torch.float32, "cpu", kv, need_sort=True)
    else:
        allocator = PagedTokenToKVPoolAllocator(size, page_size, torch.float32, "cpu", kv, need_sort=True)
    params = cache_params(table, allocator, page_size, enable_kv_cache_events=events)
    cache = build_prefix_cache(build_context(params), name=name, host_memory=host_memory,
                               manager=None if manager is None else lambda: manager)
    world = TierWorld(cache, allocator, table, page_size)
    world.kv = kv
    return world


def admit(world: TierWorld, rid: str, prompt: list[int], output: list[int], seed: int) -> tuple[object, int]:
    """What SGLang's scheduler does for a new request, with ``PrefillAdder.add_one_req``'s host-hit
    path: match (``init_next_round_input``), lock the device head, ``init_load_back`` for the host
    hit, lock the request's (new) last node, then take a row and token slots for the rest and write
    random K/V for the computed tokens. Returns the request and the tokens loaded from the host."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocation import alloc_token_slots
    from sglang.srt.sampling.sampling_params import SamplingParams

    cache, page = world.cache, world.page_size
    req = Req(
        rid=rid, origin_input_text="", origin_input_ids=array("q", prompt),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=len(output) + 1),
    )
    req.init_next_round_input(cache)
    head_lock = cache.lock(req.last_node)
    loaded = 0
    if req.host_hit_length:
        loaded, req.last_node = cache.init_load_back(
            InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req)
        )
        req.host_loaded_length = loaded
        req.prefix_len += loaded
        req.kv.cache_protected_len = req.prefix_len  # load_back_is_cache_owned()
    req.lock = cache.lock(req.last_node)
    cache.unlock(head_lock)
    prefix = cache.prefix_device_indices(req) if req.prefix_len else torch.empty(0, dtype=torch.int64)
    world.table.alloc([req])
    total = len(prompt) + len(output)
    new_tokens = total - req.prefix_len
    slots = alloc_token_slots(cache, -(-new_tokens // page) * page)[:new_tokens]
    world.table.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix)
    world.table.write((req.kv.req_pool_idx, slice(req.prefix_len, total)), slots)
    generator = torch.Generator().manual_seed(seed)
    world.tokens()[:, :, slots] = torch.randn(2, LAYERS, new_tokens, HEADS, DIM, generator=generator)
    req.output_ids = array("q", output)
    req.refresh_fill_ids()
    req.extend_end = total
    req.kv.kv_committed_len = req.kv.kv_allocated_len = total
    world.requests[rid] = req
    return req, loaded


def row_kv(world: TierWorld, req, length: int) -> torch.Tensor:
    """K/V of the request's first ``length`` tokens, read through its row: ``[2, L, length, H, D]``."""
    locations = world.table.req_to_token[req.kv.req_pool_idx, :length].long()
    return world.tokens()[:, :, locations].clone()


def prompt_of(page_size: int, pages: int, start: int = 1) -> list[int]:
    return list(range(start, start + pages * page_size))


@pytest.mark.parametrize("page_size", [1, 4])
def test_evicted_prefixes_are_written_back_and_come_back_bit_identical(page_size):
    world = tier_world(page_size)
    cache = world.cache
    first, _ = admit(world, "a", prompt_of(page_size, 4), [901, 902, 903], seed=1)
    cached_len = len(first.origin_input_ids) + 3 - (len(first.origin_input_ids) + 3) % page_size
    before = row_kv(world, first, cached_len)
    finish(world, "a")
    assert world.accounted() == world.total()

    evicted = cache.evict(EvictParams(num_tokens=EVICT_ALL)).num_tokens_evicted
    assert evicted == cached_len
    stats = cache.tier_stats()
    assert (stats.write_backs >= 1, stats.written_tokens, stats.host_evictable_tokens) == (True, cached_len, cached_len)
    assert world.allocator.available_size() == world.total() and cache.evictable_size() == 0
    world.tokens().normal_()  # the device copy is gone: only a load can bring the bytes back

    second, loaded = admit(world, "b", list(first.origin_input_ids) + [901, 902, 903, 904, 905], [7], seed=2)
    assert loaded == cached_len == second.prefix_len == second.host_hit_length
    assert second.last_node.cached_len == cached_len
    assert torch.equal(row_kv(world, second, cached_len), before)
    stats = cache.tier_stats()
    assert (stats.loads, stats.loaded_tokens, stats.host_evictable_tokens, stats.host_protected_tokens) == (1, cached_len, 0, 0)
    cache.sanity_check()
    # the loaded prefix is protected by the request, the rest of its row is the request's own
    assert cache.protected_size() == cached_len
    own = -(-(len(second.origin_input_ids) + 1 - cached_len) // page_size) * page_size  # whole pages
    assert world.allocator.available_size() + cache.protected_size() + cache.evictable_size() + own == world.total()

    finish(world, "b")
    cache.sanity_check()
    assert world.accounted() == world.total()
    cache.evict(EvictParams(num_tokens=EVICT_ALL))
    assert world.allocator.available_size() == world.total()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_match_loads_only_the_host_tail_after_the_device_head(page_size):
    world = tier_world(page_size)
    cache = world.cache
    prompt = prompt_of(page_size, 3)
    first, _ = admit(world, "a", prompt, [0] * (2 * page_size), seed=3)
    whole = row_kv(world, first, len(prompt) + 2 * page_size)
    finish(world, "a")
    # the output node is the least recently used leaf: it goes to host, the prompt stays
    cache.evict(EvictParams(num_tokens=1))
    host = cache.tier_stats().host_evictable_tokens
    assert host == 2 * page_size and cache.evictable_size() == len(prompt)

    second, loaded = admit(world, "b", prompt + [0] * (2 * page_size) + [5], [6], seed=4)
    assert (second.prefix_len - loaded, loaded) == (len(prompt), host)
    assert torch.equal(row_kv(world, second, second.prefix_len), whole)
    finish(world, "b")
    cache.sanity_check()
    assert world.accounted() == world.total()


@pytest.mark.parametrize("page_size", [1, 4])
def test_an_allocator_without_room_falls_back_to_the_device_head(page_size):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    world = tier_world(page_size, size=16 * page_size)
    cache = world.cache
    prompt = prompt_of(page_size, 4)
    admit(world, "a", prompt, [0] * page_size, seed=5)
    finish(world, "a")
    cache.evict(EvictParams(num_tokens=page_size))  # the output page goes to host, the prompt stays
    host = cache.tier_stats().host_evictable_tokens
    assert host == page_size
    # a running request takes every free page and locks the cached prompt: nothing can make room
    admit(world, "big", prompt + list(range(500, 500 + 12 * page_size)), [], seed=6)
    assert world.allocator.available_size() == 0 and cache.evictable_size() == 0

    req = Req(rid="b", origin_input_text="", origin_input_ids=array("q", prompt + [0] * page_size + [5]),
              sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
    req.init_next_round_input(cache)
    assert (req.prefix_len, req.host_hit_length) == (len(prompt), host)
    head = req.last_node
    head_lock = cache.lock(head)
    loaded, node = cache.init_load_back(
        InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req)
    )
    cache.unlock(head_lock)
    assert (loaded, node) == (0, head)  # SGLang admits it with the device head, or keeps it waiting
    stats = cache.tier_stats()
    assert (stats.loads, stats.host_evictable_tokens, stats.host_protected_tokens) == (0, host, 0)  # nothing lost
    assert world.allocator.available_size() == 0 and cache.evictable_size() == 0  # nothing taken or leaked
    finish(world, "big")
    cache.sanity_check()
    assert world.accounted() == world.total()


def test_tier_moves_are_published_with_sglangs_medium_names():
    world = tier_world(1, events=True)
    cache = world.cache
    admit(world, "a", [1, 2, 3, 4], [], seed=8)
    finish(world, "a")
    cache.take_events()

    def hashes(events, kind, medium):
        return {h for event in events if isinstance(event, kind) and event.medium == medium for h in event.block_hashes}

    cache.evict(EvictParams(num_tokens=EVICT_ALL))
    moved = cache.take_events()
    pages = hashes(moved, BlockRemoved, StorageMedium.GPU)
    assert len(pages) == 4 and hashes(moved, BlockStored, StorageMedium.CPU) == pages
    assert {event.medium for event in moved} == {StorageMedium.GPU, StorageMedium.CPU}

    admit(world, "b", [1, 2, 3, 4, 5], [], seed=9)
    back = cache.take_events()
    assert hashes(back, BlockStored, StorageMedium.GPU) == pages  # loaded: on the device again
    # the pages stay in host memory too (a host copy), until the tier lets them go
    assert hashes(back, BlockRemoved, StorageMedium.CPU) <= pages
    finish(world, "b")
    cache.reset()
    assert KV_MEDIUM_HOST == "CPU"


def test_a_page_held_in_both_media_keeps_its_hash_until_the_last_one_lets_it_go():
    """A loaded prefix keeps its host copy: the translator must name the same SGLang hash when the
    device copy goes and again when the host copy goes (and chain children to it meanwhile)."""
    from kvplug.interface import KV_MEDIUM_DEVICE
    from kvplug.interface import BlockRemoved as KvplugRemoved
    from kvplug.interface import BlockStored as KvplugStored

    world = tier_world(1, events=True)
    cache = world.cache
    tier = cache.root_node.space.cache
    cache.take_events()
    for event in (
        KvplugStored((11,), None, (1,), 1, KV_MEDIUM_HOST),
        KvplugStored((11,), None, (1,), 1, KV_MEDIUM_DEVICE),
        KvplugRemoved((11,), KV_MEDIUM_DEVICE),
        KvplugStored((12,), 11, (2,), 1, KV_MEDIUM_HOST),
        KvplugRemoved((12,), KV_MEDIUM_HOST),
        KvplugRemoved((11,), KV_MEDIUM_HOST),
    ):
        tier.emit_kv_event(event)
    events = cache.take_events()
    stored = [event for event in events if isinstance(event, BlockStored)]
    removed = [event for event in events if isinstance(event, BlockRemoved)]
    page = stored[0].block_hashes[0]
    assert [event.block_hashes for event in stored] == [[page], [page], stored[2].block_hashes]
    assert stored[2].parent_block_hash == page
    # (SGLang's recorder coalesces consecutive removals of one medium into one event)
    assert [(h, event.medium) for event in removed for h in event.block_hashes] == [
        (page, StorageMedium.GPU), (stored[2].block_hashes[0], StorageMedium.CPU), (page, StorageMedium.CPU),
    ]


# ============================================================================ the flag


def parse(*flags: str) -> ServerArgs:
    return prepare_server_args(["--model-path", "dummy", *flags])


def test_the_flag_travels_in_sglangs_radix_cache_backend_field():
    args = parse("--kv-backend", "kvplug", "--kvplug-host-memory", "64MiB")
    assert args.radix_cache_backend == "kvplug:radix+host_memory=67108864"
    assert names.split_host_memory(args.radix_cache_backend) == ("kvplug:radix", 64 << 20)
    assert names.prefix_cache_of(args.radix_cache_backend) == "radix"
    explicit = parse("--kv-backend", "kvplug", "--radix-cache-backend", "kvplug:radix", "--kvplug-host-memory", "1000")
    assert explicit.radix_cache_backend == "kvplug:radix+host_memory=1000"
    # the scheduler's registry lookup (hooked) resolves it to radix's factory with the tier
    factory = get_radix_cache_factory(args.radix_cache_backend)
    assert factory.keywords["host_memory"] == 64 << 20 and factory.keywords["name"] == "radix"
    with pytest.raises(ValueError, match="a positive integer"):
        get_radix_cache_factory("kvplug:radix+host_memory=1000+x")
    assert get_radix_cache_factory("kvplug:no-such-cache+host_memory=1000") is None


def test_the_kvplug_host_spells_the_tier_for_the_cli_and_for_sglang_engine():
    import kvplug

    host = kvplug.default_manager().create("host", "sglang", attention="torch", host_memory="2MiB")
    args = parse(*host.cli_args())
    assert host.engine_kwargs()["radix_cache_backend"] == args.radix_cache_backend == "kvplug:radix+host_memory=2097152"
    for field, value in host.engine_kwargs().items():
        assert getattr(args, field) == value
    with pytest.raises(kvplug.InvalidArgumentError, match="like '40GiB'"):
        kvplug.default_manager().create("host", "sglang", host_memory="much")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--kvplug-host-memory", "1GiB"), "--kvplug-host-memory needs --kv-backend kvplug"),
        (("--radix-cache-backend", "kvplug:radix", "--kvplug-host-memory", "1GiB"), "needs --kv-backend kvplug"),
        (("--kv-backend", "kvplug", "--prefix-cache", "naive", "--kvplug-host-memory", "1GiB"), "'naive'"),
        (("--kv-backend", "kvplug", "--kvplug-host-memory", "lots"), "like '40GiB'"),
        (("--kv-backend", "kvplug", "--kvplug-host-memory", "0"), "must be positive"),
        (("--kv-backend", "kvplug", "--kvplug-host-memory", "1GiB", "--enable-hierarchical-cache"), "--enable-hierarchical-cache"),
        (("--kv-backend", "kvplug", "--kvplug-host-memory", "1GiB", "--disable-radix-cache"), "drop --disable-radix-cache"),
    ],
)
def test_the_flag_is_refused_where_it_cannot_work(flags, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*flags)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_over_sglangs_own_pools_the_tier_is_refused_naming_kv_backend_kvplug():
    table, allocator = make_pools(size=32, page_size=1, max_requests=2, max_context=16)
    with pytest.raises(ValueError, match="--kv-backend kvplug"):
        build_prefix_cache(build_context(cache_params(table, allocator, 1)), name="radix", host_memory=HOST_MEMORY)


def test_the_hierarchical_cache_stays_refused_with_a_tier():
    world = tier_world(1)
    context = build_context(cache_params(world.table, world.allocator, 1), enable_hierarchical_cache=True)
    with pytest.raises(NotImplementedError, match="enable-hierarchical-cache"):
        build_prefix_cache(context, name="radix", host_memory=HOST_MEMORY)


def test_only_the_default_namespace_holds_host_memory_and_a_flush_keeps_it():
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from kvplug.interface import BaseTieredPrefixCache

    world = tier_world(1)
    cache = world.cache
    pool = cache.root_node.space.cache.host_pool
    cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2], extra_key="lora-a")))
    tiered = [space.namespace for space in cache._spaces if isinstance(space.cache, BaseTieredPrefixCache)]
    assert tiered == [(None, None)] and len(list(cache._spaces)) == 2
    cache.reset()
    assert cache.root_node.space.cache.host_pool is pool  # no second allocation on /flush_cache
    assert cache.tier_stats().host_pages == pool.num_pages


def test_a_cpu_cache_attaches_to_a_pool_on_another_device():
    """kvplug caches live on the CPU in SGLang while the pool is on the accelerator (``meta`` stands
    in for CUDA here; ``test_sglang_host_tier_gpu.py`` runs the real thing)."""
    from types import SimpleNamespace

    import kvplug

    pool = SimpleNamespace(kv_buffer=torch.empty(2, LAYERS, 9, 4, HEADS, DIM, device="meta"))
    cache = kvplug.default_manager().create_prefix_cache("radix", device="cpu", page_size=4, host_memory=HOST_MEMORY)
    cache.attach_kv_pool(pool)
    assert cache.host_pool.num_pages == HOST_MEMORY // (2 * LAYERS * 4 * HEADS * DIM * 4)
    assert not cache.host_pool.pinned and cache.host_pool.buffer.device.type == "cpu"


@pytest.mark.parametrize(
    ("host_memory", "error", "message"),
    [
        (1, "InvalidArgumentError", "host_memory=1 bytes holds no KV page of 512 bytes"),
        (511, "InvalidArgumentError", "host_memory=511 bytes holds no KV page of 512 bytes"),
        (1000 << 40, "OutOfMemoryError", "the host-memory tier needs 1,099,511,627,776,000 bytes"),
    ],
)
def test_a_tier_below_one_page_or_past_free_memory_fails_the_tree_cache_build(host_memory, error, message):
    """Issue 32: SGLang builds its tree cache in the scheduler's constructor, before the server is
    ready; a bad size must fail there (naming both sizes), not at the first eviction. A page here is
    2 (K, V) x 2 layers x 4 tokens x 2 heads x 4 dims x 4 bytes = 512 bytes."""
    import kvplug

    with pytest.raises((kvplug.InvalidArgumentError, kvplug.OutOfMemoryError), match=message) as info:
        tier_world(4, host_memory=host_memory)
    assert type(info.value).__name__ == error
    if error == "OutOfMemoryError":
        assert "of host memory are available" in str(info.value)  # the second size
