"""A randomised run of ``KVBackend``'s whole public lifecycle with the KV contents checked.

Every forward writes K/V that are a function of (token id, position) only, so a prefix found in
the cache must hold exactly what recomputing it would write: after random admissions (prompts
sharing prefixes, so radix hits), chunked prefills, decode steps (explicit ``begin_decode`` /
``commit`` and call by call), finishes (computed or aborted), lazy-free regions, evictions in a
pool too small for the load and refused calls (each must change nothing), every live request's
K/V read through its table row equal that function, and every memory invariant holds.

The CI run makes 20,000 operations per configuration; ``--run-slow`` makes 220,000 per
configuration, 1.1 million in all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvplug
from kvplug.backend import KVBackend, ModelShape, create_backend
from kvplug.interface import InvalidArgumentError, OutOfMemoryError

SHAPE = ModelShape(num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)


def kv_of(token_ids: torch.Tensor, positions: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """The K (and, negated, V) a forward writes for tokens at positions: shape ``[n, heads, dim]``,
    float32, exact (token * 1000 + position, plus the element's index)."""
    base = token_ids.double() * 1000 + positions.double()
    return (base[:, None] + torch.arange(heads * dim, dtype=torch.float64)).float().view(-1, heads, dim)


class Soak:
    """One backend and the requests it runs, driven by ``rng`` (see the module docstring)."""

    def __init__(self, manager, page_size: int, prefix_cache: str, rng: np.random.Generator, host_views: bool,
                 **options):
        self.rng = rng
        self.backend = _backend(manager, page_size, prefix_cache, host_views, **options)
        self.prefixes = [rng.integers(0, 500, int(rng.integers(8, 40))).tolist() for _ in range(4)]
        self.running: list = []  # requests with one known token past the cached ones
        self.tokens: dict[int, list[int]] = {}  # row -> every token id of its request
        self.operations = 0
        self.refused = 0

    # ------------------------------------------------------------------ operations
    def step(self) -> None:
        roll = self.rng.random()
        if roll < 0.25 and len(self.running) < self.backend.max_running_reqs:
            self.admit()
        elif roll < 0.33 and self.running:
            self.finish()
        elif roll < 0.37:
            self.refuse_bad_call()
        elif self.running:
            self.decode()
        self.operations += 1

    def admit(self) -> None:
        prefix = self.prefixes[int(self.rng.integers(len(self.prefixes)))]
        prompt = prefix[: int(self.rng.integers(1, len(prefix) + 1))] + self.rng.integers(
            0, 500, int(self.rng.integers(0, 12))).tolist()
        prompt = prompt[: self.backend.max_seq_len - 4] or [1]
        backend = self.backend
        request = backend.admit(prompt)
        self.tokens[request.row] = list(prompt)
        try:
            while request.cached_len < len(prompt):
                end = min(len(prompt), request.cached_len + int(self.rng.integers(1, 24)))
                backend.allocate([request], [end])
                batch = backend.prepare([request], "prefill")
                self.forward(batch)
                if end < len(prompt):
                    backend.cache_unfinished(request)
                    self.operations += 1
                else:
                    sampled = int(self.rng.integers(0, 500))
                    backend.append_tokens([request], [sampled])
                    self.tokens[request.row].append(sampled)
                self.operations += 2
        except OutOfMemoryError:
            backend.finish(request, computed=False)  # the computed chunks may stay cached
            del self.tokens[request.row]
            return
        self.running.append(request)

    def decode(self) -> None:
        backend, rng = self.backend, self.rng
        requests = [r for r in self.running if r.num_tokens < backend.max_seq_len - 1]
        if not requests:
            self.finish()
            return
        rng.shuffle(requests)
        requests = requests[: int(rng.integers(1, len(requests) + 1))]
        sampled = rng.integers(0, 500, len(requests))
        try:
            if rng.random() < 0.6:
                step = backend.begin_decode(requests)
                self.forward(step.batch)
                step.commit(torch.tensor(sampled, dtype=torch.int32))
            else:
                backend.allocate(requests)
                batch = backend.prepare(requests, "decode")
                self.forward(batch)
                backend.append_tokens(requests, torch.tensor(sampled, dtype=torch.int32))
        except OutOfMemoryError:
            self.finish()  # make room: the scheduler would preempt
            return
        for request, token in zip(requests, sampled):
            self.tokens[request.row].append(int(token))
        self.operations += 2

    def forward(self, batch) -> None:
        """Write the batch's K/V (a function of token id and position) at its out_loc."""
        pool = self.backend.pool
        kv = kv_of(self.backend.input_ids(batch), batch.positions, pool.local_kv_heads, pool.head_dim)
        pool.store_kv(kv, -kv, batch.out_loc, 0)

    def finish(self) -> None:
        request = self.running.pop(int(self.rng.integers(len(self.running))))
        with self.backend.lazy_free() if self.rng.random() < 0.5 else _nothing():
            self.backend.finish(request, computed=bool(self.rng.random() < 0.5))
        del self.tokens[request.row]

    def refuse_bad_call(self) -> None:
        """A call that must be refused with nothing changed."""
        backend, rng = self.backend, self.rng
        before = (backend.stats(), [r.lengths() for r in self.running])
        choice = int(rng.integers(5))
        with pytest.raises((InvalidArgumentError, OutOfMemoryError)):
            if choice == 0:
                backend.admit([-1, 2])
            elif choice == 1 and self.running:
                backend.append_tokens(self.running[:1], [1, 2])  # two ids for one request
            elif choice == 2 and self.running:
                backend.prepare(self.running[:1] * 2, "decode")
            elif choice == 3:
                backend.allocate([object()])
            else:
                backend.begin_decode([])
        self.refused += 1
        assert (backend.stats(), [r.lengths() for r in self.running]) == before

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        backend = self.backend
        backend.check_integrity()
        heads, dim = backend.pool.local_kv_heads, backend.pool.head_dim
        k_cache = backend.pool.k_cache(0).reshape(-1, heads, dim)
        v_cache = backend.pool.v_cache(0).reshape(-1, heads, dim)
        for request in self.running:
            known = self.tokens[request.row]
            assert request.num_tokens == len(known)
            cached = request.cached_len
            assert backend.token_pool[request.row, : len(known)].tolist() == known
            locations = backend.page_table[request.row, :cached].long()
            expected = kv_of(torch.tensor(known[:cached]), torch.arange(cached), heads, dim)
            assert torch.equal(k_cache[locations], expected), f"row {request.row}: K differs"
            assert torch.equal(v_cache[locations], -expected), f"row {request.row}: V differs"


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _backend(manager, page_size: int, prefix_cache: str, host_views: bool, **options) -> KVBackend:
    if host_views:
        return create_backend(SHAPE, page_size=page_size, num_pages=160 // page_size + 2, max_running_reqs=6,
                              max_seq_len=96, prefix_cache=prefix_cache, attention=None, manager=manager, **options)
    from tests.test_backend import _backend_with_tables  # the torch path a GPU table takes

    return _backend_with_tables(manager, page_size, host_views=False, prefix_cache=prefix_cache,
                                num_pages=160 // page_size + 2, **options)


def run_soak(manager, page_size: int, prefix_cache: str, host_views: bool, operations: int, seed: int,
             **options) -> Soak:
    soak = Soak(manager, page_size, prefix_cache, np.random.default_rng(seed), host_views, **options)
    next_check = 0
    while soak.operations < operations:
        soak.step()
        if soak.operations >= next_check:
            soak.check()
            next_check = soak.operations + 50
    soak.check()
    return soak


@pytest.fixture(scope="module")
def manager():
    return kvplug.PluginManager(entry_points=False)


CONFIGS = [(1, "radix", True), (4, "radix", False), (16, "radix", True), (16, "naive", False), (4, "naive", True)]


@pytest.mark.parametrize("page_size, prefix_cache, host_views", CONFIGS)
def test_random_lifecycle_keeps_kv_contents_and_invariants(manager, page_size, prefix_cache, host_views):
    soak = run_soak(manager, page_size, prefix_cache, host_views, operations=20_000, seed=page_size)
    stats = soak.backend.stats()
    assert soak.refused > 200 and stats.finished_requests > 100
    if prefix_cache == "radix":
        assert stats.cache_hit_tokens > 0 and stats.evicted_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("page_size, prefix_cache, host_views", CONFIGS)
def test_a_million_operations_keep_kv_contents_and_invariants(manager, page_size, prefix_cache, host_views):
    soak = run_soak(manager, page_size, prefix_cache, host_views, operations=220_000, seed=100 + page_size)
    print(f"page {page_size} {prefix_cache} host_views={host_views}: {soak.operations} operations, "
          f"{soak.refused} refused calls, {soak.backend.stats()}")


# a faulty cache plugin (issue 32): it misbehaves after some calls, a fresh instance of it takes
# over and misbehaves again, then ``naive``; the K/V of every running request stays exact through
# both hand-overs (their locked prefixes become their own pages) and every invariant holds
FAULTY_CONFIGS = [(4, "insert_prefix:raise", False), (1, "match_prefix:twice", True), (16, "evict:short", True),
                  (4, "size_info:overstates_evictable", False), (4, "unlock:raise", True),
                  (1, "insert_prefix:huge_cached_len", False), (16, "match_prefix:outside_pool", False)]


@pytest.mark.parametrize("page_size, fault, host_views", FAULTY_CONFIGS)
def test_random_lifecycle_with_a_faulty_cache_plugin(page_size, fault, host_views):
    from tests.faulty_cache import FaultyCachePlugin

    manager = kvplug.PluginManager(entry_points=False)
    manager.register(FaultyCachePlugin(), "faulty-cache-soak")
    soak = run_soak(manager, page_size, "faulty", host_views, operations=6_000, seed=page_size,
                    prefix_cache_options={"fault": fault, "after": 40}, fallback_prefix_cache="faulty")
    stats = soak.backend.stats()
    assert stats.prefix_cache["cache_failures"] == 2 and stats.prefix_cache["prefix_cache"] == "naive", stats
    assert soak.refused > 50 and stats.finished_requests > 30
