"""Conformance checks for tiered prefix caches (``kvplug.BaseTieredPrefixCache``): a host-memory tier.

One call runs them all against a factory::

    from kvplug.testing import check_tiered_prefix_cache
    check_tiered_prefix_cache(my_factory, page_sizes=(1, 4, 16))

``my_factory(config)`` must return a ``BaseTieredPrefixCache`` built from ``config`` (whose
``options`` carry ``host_memory`` in bytes, the option the built-in ``radix`` takes; a plugin may
read it or ignore it). The kit attaches a small CPU ``mha`` pool (``attach_kv_pool``) whose K/V
bytes it controls, then checks:

- the whole version-1 suite (``check_prefix_cache``) with the tier underneath: evictions move
  prefixes to host memory, and the version-1 view (the device tier) must stay exact;
- ``round_trip_is_bit_identical``: a prefix evicted to host memory and loaded back into other
  device pages holds exactly the bytes it had, for every layer, K and V;
- ``host_shortage_drops_least_recent``: a full host tier drops its least recently used prefixes
  first and keeps the recent ones loadable;
- ``locked_host_prefix_is_kept``: a locked host-resident prefix is never dropped, however much is
  evicted, and loads intact afterwards;
- ``randomised_tiered_run``: seeded random inserts, matches with loads, locks, unlocks, evictions
  and resets, with ``check_integrity()`` after each and, on every match, the matched pages' K/V
  compared with what was written for those tokens (nothing stale is ever served).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Iterable

import torch

from kvplug.interface import BaseTieredPrefixCache, HostLoad, KVPoolConfig, PrefixCacheConfig
from kvplug.testing.context import PrefixCacheFactory
from kvplug.testing.prefix_cache import DEFAULT_PAGE_SIZES, left_out_checks, prefix_cache_checks
from kvplug.testing.report import KitReport, factory_name

#: Device token locations the kit's pool holds (the version-1 checks use locations below this).
KIT_POOL_TOKENS = 16384
KIT_LAYERS, KIT_HEADS, KIT_HEAD_DIM = 2, 2, 2


class TieredKit:
    """A tiered cache under test with the small pool the kit attaches, and K/V fingerprints.

    The K/V written for token position ``j`` of a sequence is a function of the tokens up to
    ``j`` (``fingerprint``), as in a real model, so a page served for the wrong prefix shows up.
    """

    def __init__(self, factory: PrefixCacheFactory, page_size: int, host_pages: int) -> None:
        from kvplug.memory.mha_pool import MHAKVPool

        self.page_size = page_size
        self.pool = MHAKVPool(KVPoolConfig(
            num_layers=KIT_LAYERS, num_kv_heads=KIT_HEADS, head_dim=KIT_HEAD_DIM,
            num_pages=KIT_POOL_TOKENS // page_size, page_size=page_size, dtype=torch.float32,
            device=torch.device("cpu"),
        ))
        page_bytes = self.pool.bytes_per_token * page_size
        config = PrefixCacheConfig(device="cpu", page_size=page_size, options={"host_memory": host_pages * page_bytes})
        self.cache = factory(config)
        assert isinstance(self.cache, BaseTieredPrefixCache), (
            f"the factory must return a kvplug.BaseTieredPrefixCache, got {type(self.cache).__name__}"
        )
        self.cache.attach_kv_pool(self.pool)
        self.rows = self.pool.kv_buffer.view(2, KIT_LAYERS, -1, KIT_HEADS, KIT_HEAD_DIM)

    @staticmethod
    def fingerprint(tokens: Iterable[int]) -> float:
        value = 17
        for token in tokens:
            value = (value * 1_000_003 + token + 1) % 8_388_593  # exact in float32
        return float(value)

    def write(self, tokens: list[int], locations: list[int]) -> None:
        """Store the K/V of every token of ``tokens`` at ``locations``."""
        values = torch.tensor([self.fingerprint(tokens[: j + 1]) for j in range(len(tokens))])
        offsets = torch.arange(2 * KIT_LAYERS * KIT_HEADS * KIT_HEAD_DIM, dtype=torch.float32).view(
            2, KIT_LAYERS, 1, KIT_HEADS, KIT_HEAD_DIM
        )
        self.rows[:, :, torch.tensor(locations)] = values.view(1, 1, -1, 1, 1) + offsets / 64

    def check_content(self, tokens: list[int], locations: list[int], what: str) -> None:
        """The K/V at ``locations`` must be what ``write`` stored for ``tokens``."""
        if not locations:
            return
        expected = torch.tensor([self.fingerprint(tokens[: j + 1]) for j in range(len(locations))])
        actual = self.rows[0, 0, torch.tensor(locations), 0, 0]
        bad = (actual != expected).nonzero()
        assert bad.numel() == 0, (
            f"{what}: K/V at position {int(bad[0])} (location {locations[int(bad[0])]}) is stale or foreign"
        )

    def clobber(self, locations: list[int]) -> None:
        """Overwrite device locations (freed pages get reused by other requests)."""
        if locations:
            self.rows[:, :, torch.tensor(locations)] = -1.0

    def match_and_load(self, tokens: list[int], free: list[int], *, start: bool = False) -> tuple[Any, list[int], int]:
        """Match ``tokens``; load the host part into locations taken from the front of ``free``
        (``start``: through ``start_host_load``, ordering the returned load before reading).

        Returns the locked handle, its locations, and how many tokens came from host memory.
        """
        cache = self.cache
        ids = torch.tensor(tokens, dtype=torch.int32)
        match = cache.match_tiered(ids)
        assert match.handle.cached_len + match.host_len == match.host_handle.cached_len, "match_tiered lengths disagree"
        assert match.host_len % self.page_size == 0, f"host_len {match.host_len} is not whole pages"
        cache.lock_handle(match.handle)
        handle = match.handle
        if match.host_len:
            assert match.host_len <= len(free), "kit ran out of free locations"
            cache.lock_handle(match.host_handle)
            targets = free[: match.host_len]
            del free[: match.host_len]
            if start:
                load = cache.start_host_load(match.host_handle, torch.tensor(targets, dtype=torch.int32))
                assert isinstance(load, HostLoad), f"start_host_load returned {type(load).__name__}, not a HostLoad"
                handle = load.handle
                assert handle.cached_len == match.host_handle.cached_len, "a started load changed the prefix length"
                in_flight = cache.loads_in_flight(handle)
                assert isinstance(in_flight, tuple) and all(isinstance(one, HostLoad) for one in in_flight), (
                    f"loads_in_flight must return a tuple of HostLoad, got {in_flight!r}"
                )
                load.order_before()
            else:
                handle = cache.load_host_prefix(match.host_handle, torch.tensor(targets, dtype=torch.int32))
            cache.lock_handle(match.handle, unlock=True)
        locations = handle.get_matched_indices().tolist()
        assert len(locations) == handle.cached_len, "get_matched_indices length != cached_len"
        return handle, locations, int(match.host_len)


def _page_tokens(page: int, page_size: int) -> list[int]:
    return [page * 7 + 1 + i for i in range(page_size)]


def round_trip_is_bit_identical(kit: TieredKit) -> None:
    """A prefix evicted to host memory and loaded back holds exactly its K/V bytes."""
    P = kit.page_size
    tokens = [t for page in range(4) for t in _page_tokens(page, P)]
    locations = list(range(3 * P, 7 * P))
    kit.write(tokens, locations)
    before = kit.rows[:, :, torch.tensor(locations)].clone()
    kit.cache.insert_prefix(torch.tensor(tokens, dtype=torch.int32), torch.tensor(locations, dtype=torch.int32))
    freed = kit.cache.evict(len(tokens)).tolist()
    kit.cache.check_integrity()
    assert sorted(freed) == locations, f"evict freed {sorted(freed)}, expected {locations}"
    assert kit.cache.size_info.total_size == 0, "the device tier still holds tokens after evicting all"
    assert kit.cache.host_size_info.total_size == len(tokens), (
        f"host tier holds {kit.cache.host_size_info.total_size} tokens, expected {len(tokens)}"
    )
    kit.clobber(locations)
    handle, loaded, host_len = kit.match_and_load(tokens, list(range(100 * P, 104 * P)))
    kit.cache.check_integrity()
    assert host_len == len(tokens) and loaded == list(range(100 * P, 104 * P)), (
        f"expected all {len(tokens)} tokens loaded into the given locations, got host_len={host_len}, {loaded}"
    )
    after = kit.rows[:, :, torch.tensor(loaded)]
    assert torch.equal(before, after), "K/V bytes differ after a device -> host -> device round trip"
    assert kit.cache.host_size_info.total_size == 0 and kit.cache.size_info.protected_size == len(tokens)
    kit.cache.lock_handle(handle, unlock=True)
    kit.cache.check_integrity()


def host_shortage_drops_least_recent(kit: TieredKit) -> None:
    """When host memory is full, the least recently used host-resident prefixes are dropped first."""
    P = kit.page_size
    sequences = [[t for page in range(base, base + 2) for t in _page_tokens(page, P)] for base in (10, 20, 30, 40)]
    for number, tokens in enumerate(sequences):  # host tier: 6 pages; each sequence is 2
        locations = list(range(number * 2 * P, (number + 1) * 2 * P))
        kit.write(tokens, locations)
        kit.cache.insert_prefix(torch.tensor(tokens, dtype=torch.int32), torch.tensor(locations, dtype=torch.int32))
        kit.cache.evict(2 * P)
        kit.cache.check_integrity()
        kit.clobber(locations)
    assert kit.cache.host_size_info.total_size == 6 * P, (
        f"a full 6-page host tier holds {kit.cache.host_size_info.total_size} tokens, expected {6 * P}"
    )
    free = list(range(200 * P, 260 * P))
    first = kit.cache.match_tiered(torch.tensor(sequences[0], dtype=torch.int32))
    assert first.handle.cached_len + first.host_len == 0, "the least recently used prefix was not the one dropped"
    for tokens in sequences[1:]:
        handle, locations, host_len = kit.match_and_load(tokens, free)
        assert host_len == len(tokens), f"a recent prefix lost its host copy (host_len {host_len} of {len(tokens)})"
        kit.check_content(tokens, locations, "a prefix loaded from the host tier")
        kit.cache.lock_handle(handle, unlock=True)
        kit.cache.check_integrity()


def locked_host_prefix_is_kept(kit: TieredKit) -> None:
    """A locked host-resident prefix survives any amount of eviction and loads intact."""
    P = kit.page_size
    kept = [t for page in range(50, 52) for t in _page_tokens(page, P)]
    kit.write(kept, list(range(2 * P)))
    kit.cache.insert_prefix(torch.tensor(kept, dtype=torch.int32), torch.tensor(list(range(2 * P)), dtype=torch.int32))
    kit.cache.evict(2 * P)
    kit.clobber(list(range(2 * P)))
    match = kit.cache.match_tiered(torch.tensor(kept, dtype=torch.int32))
    assert match.host_len == 2 * P, f"expected the prefix in host memory, host_len={match.host_len}"
    kit.cache.lock_handle(match.host_handle)
    assert kit.cache.host_size_info.protected_size == 2 * P, "a locked host prefix is not counted as protected"
    for number in range(8):  # 8 x 2 pages written back into a 6-page tier with 2 pages locked
        tokens = [t for page in range(60 + 2 * number, 62 + 2 * number) for t in _page_tokens(page, P)]
        locations = list(range((10 + 2 * number) * P, (12 + 2 * number) * P))
        kit.write(tokens, locations)
        kit.cache.insert_prefix(torch.tensor(tokens, dtype=torch.int32), torch.tensor(locations, dtype=torch.int32))
        kit.cache.evict(2 * P)
        kit.cache.check_integrity()
    targets = list(range(300 * P, 302 * P))
    kit.cache.load_host_prefix(match.host_handle, torch.tensor(targets, dtype=torch.int32))
    kit.cache.check_integrity()
    assert match.host_handle.get_matched_indices().tolist() == targets, "the loaded prefix does not use the given pages"
    kit.check_content(kept, targets, "a locked host prefix after heavy eviction")
    kit.cache.lock_handle(match.host_handle, unlock=True)


def randomised_tiered_run(kit: TieredKit, *, seed: int = 0, operations: int = 60) -> None:
    """Seeded random operations; integrity after each, K/V content checked on every match."""
    P = kit.page_size
    rng = random.Random(seed)
    cache = kit.cache
    free = list(range(KIT_POOL_TOKENS // 2 // P * P, KIT_POOL_TOKENS - P))  # locations for loads
    next_location = 0
    held: list[Any] = []
    vocabulary = [[1, 2, 3, 4], [1, 2, 5], [6, 7], [1, 8, 9, 10], [6, 11]]
    for number in range(operations):
        kind = rng.choice(("insert", "insert", "match", "match", "unlock", "evict", "evict", "reset" if number % 29 == 28 else "match"))
        base = rng.choice(vocabulary)
        pages = base[: rng.randint(1, len(base))] + ([rng.randint(20, 24)] if rng.random() < 0.3 else [])
        tokens = [t for page in pages for t in _page_tokens(page, P)]
        what = f"operation #{number} {kind}(pages={pages})"
        if kind == "insert":
            if next_location + len(tokens) > KIT_POOL_TOKENS // 2:
                continue
            locations = list(range(next_location, next_location + len(tokens)))
            next_location += len(tokens)
            kit.write(tokens, locations)
            result = cache.insert_prefix(torch.tensor(tokens, dtype=torch.int32), torch.tensor(locations, dtype=torch.int32))
            cached = result.handle.get_matched_indices().tolist()
            kit.check_content(tokens, cached, what)
            # the caller frees its duplicates: leftovers are overwritten by other work
            kit.clobber(locations[: result.cached_len])
        elif kind == "match":
            if len(free) < len(tokens):
                continue
            handle, locations, _ = kit.match_and_load(tokens, free, start=rng.random() < 0.5)
            kit.check_content(tokens, locations, what)
            if rng.random() < 0.5:
                held.append(handle)
            else:
                cache.lock_handle(handle, unlock=True)
        elif kind == "unlock" and held:
            cache.lock_handle(held.pop(rng.randrange(len(held))), unlock=True)
        elif kind == "evict":
            evictable = cache.size_info.evictable_size
            if evictable:
                freed = cache.evict(rng.randint(1, evictable)).tolist()
                kit.clobber(freed)  # a freed page is reused at once: its old bytes are gone
        elif kind == "reset":
            cache.reset()
            held.clear()
        try:
            cache.check_integrity()
        except AssertionError as error:
            raise AssertionError(f"{what}: {error}") from error
    for handle in held:
        cache.lock_handle(handle, unlock=True)
    cache.check_integrity()


_TIER_CHECKS: tuple[tuple[Callable[..., None], int], ...] = (  # (check, host pages of the kit's tier)
    (round_trip_is_bit_identical, 8),
    (host_shortage_drops_least_recent, 6),
    (locked_host_prefix_is_kept, 6),
    (randomised_tiered_run, 5),
)


def check_tiered_prefix_cache(
    factory: PrefixCacheFactory,
    page_sizes: Iterable[int] = DEFAULT_PAGE_SIZES,
    *,
    randomised: bool = True,
    seeds: int = 8,
    shrink: bool = True,
    lru: bool = True,
) -> KitReport:
    """Run the version-1 suite with a tier attached and the tier checks (module docstring) at each
    page size; the first failure raises ``AssertionError`` naming the check. Returns the
    ``KitReport`` of the passed run (``print`` it for the summary).

    Args:
        factory: ``factory(config) -> BaseTieredPrefixCache`` (``config.options["host_memory"]``
            holds the tier's size in bytes).
        page_sizes: page sizes to build caches with.
        randomised: include the randomised checks (the version-1 differential one needs hypothesis).
        seeds: runs of ``randomised_tiered_run`` per page size (seeds ``0 .. seeds - 1``).
        shrink: passed to the version-1 randomised check.
        lru: ``False`` for a cache whose eviction order is not strict least-recently-used (such
            as ``radix`` with ``split_refreshes_tail``): the version-1 LRU-order checks and
            ``host_shortage_drops_least_recent`` are left out, as ``check_prefix_cache(lru=False)``
            does; everything else still runs.
    """
    sizes = tuple(page_sizes)
    names: list[str] = []
    left_out = left_out_checks(lru=lru, randomised=randomised)
    runs = 0
    for page_size in sizes:
        def attached(config: PrefixCacheConfig, host_pages: int = 6) -> Any:
            return TieredKit(
                lambda tiered_config: factory(dataclasses.replace(tiered_config, device=config.device)),
                config.page_size, host_pages,
            ).cache

        for check in prefix_cache_checks(lru=lru, randomised=randomised):
            check.run(attached, page_size, "cpu", shrink=shrink)
            runs += 1
            if check.name not in names:
                names.append(check.name)
        for function, host_pages in _TIER_CHECKS:
            seed_runs = range(seeds) if function is randomised_tiered_run and randomised else [0]
            if function is randomised_tiered_run and not randomised:
                _note(left_out, function.__name__, "randomised=False")
                continue
            if function is host_shortage_drops_least_recent and not lru:
                _note(left_out, function.__name__, "lru=False")
                continue
            if function.__name__ not in names:
                names.append(function.__name__)
            runs += len(seed_runs)
            for seed in seed_runs:
                kit = TieredKit(factory, page_size, host_pages)
                try:
                    if function is randomised_tiered_run:
                        function(kit, seed=seed)
                    else:
                        function(kit)
                except Exception as error:
                    raise AssertionError(
                        f"tiered prefix-cache check {function.__name__!r} failed (page_size={page_size}"
                        f"{f', seed={seed}' if function is randomised_tiered_run else ''}): "
                        f"{type(error).__name__}: {error}"
                    ) from error
    return KitReport("tiered prefix cache", factory_name(factory), sizes, tuple(names), tuple(left_out), runs)


def _note(left_out: list[tuple[str, str]], name: str, why: str) -> None:
    if (name, why) not in left_out:
        left_out.append((name, why))


__all__ = ["TieredKit", "check_tiered_prefix_cache"]
