"""Hypothesis state machine over long random admit / grow / forward / chunk / decode / finish
cycles, with radix, the dict reference cache and naive, at several page sizes.

Every forward writes a fake K/V value into the pool locations it was given: a hash of the token
prefix ending at that position, exactly what a real model's K/V depends on. After every step:

- ``check_integrity``: conservation (free + cached + owned == num_pages), no page owned twice,
  page-aligned free list, dummy page never in the free list, dummy row intact;
- every live request's computed tokens still hold the K/V of *its* prefix (no one overwrote a
  page it owns or shares), and its token-pool row equals the model's tokens;
- no location handed out lies in the dummy page.

At admission, the matched prefix must hold the K/V of the same tokens (the cache maps token ids to
the right locations). A failed allocation must leave the free list, table, cache and requests
unchanged.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvplug.backend import create_backend
from kvplug.interface import OutOfMemoryError
from kvplug.memory.model_shape import ModelShape
from tests.test_allocator import DictPrefixCache, assert_same, snapshot

POOL_TOKENS = 96
MAX_SEQ_LEN = 48
MAX_ROWS = 4
VOCAB = 6
_bases = random.Random(1234)
SHARED_PREFIXES = [[_bases.randrange(VOCAB) for _ in range(40)] for _ in range(3)]
SHAPE = ModelShape(num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)


def prefix_hashes(tokens: list[int]) -> list[int]:
    values, state = [], 0
    for token in tokens:
        state = (state * 1_000_003 + token + 1) % (1 << 61)
        values.append(state)
    return values


def build_cache(kind: str, page_size: int):
    if kind == "dict":
        return DictPrefixCache(page_size)
    if kind == "radix":
        pytest.importorskip("kvplug.prefix_cache.radix")
    return kind


class LifecycleMachine(RuleBasedStateMachine):
    cache_kind = "radix"
    page_size = 4

    def __init__(self) -> None:
        super().__init__()
        size = self.page_size
        self.backend = create_backend(
            SHAPE,
            page_size=size,
            num_pages=POOL_TOKENS // size,
            max_running_reqs=MAX_ROWS,
            max_seq_len=MAX_SEQ_LEN,
            prefix_cache=build_cache(self.cache_kind, size),
            attention=None,
        )
        self.kv = torch.full(((POOL_TOKENS // size + 1) * size,), -1, dtype=torch.int64)
        self.tokens: dict[int, list[int]] = {}
        self.live: dict[int, object] = {}

    # ------------------------------------------------------------------ rules
    @rule(base=st.integers(0, 2), cut=st.integers(0, 40), extra=st.lists(st.integers(0, VOCAB - 1), max_size=8))
    def admit(self, base, cut, extra):
        prompt = (SHARED_PREFIXES[base][:cut] + extra)[: MAX_SEQ_LEN - 1] or [0]
        if self.backend.requests.num_live == self.backend.max_running_reqs:
            with pytest.raises(OutOfMemoryError):
                self.backend.admit(prompt)
            return
        request = self.backend.admit(prompt)
        matched = request.matched_len
        assert matched % self.page_size == 0 and matched < len(prompt)
        locations = self.backend.page_table[request.row, :matched].long()
        assert self.kv[locations].tolist() == prefix_hashes(prompt)[:matched]
        self.tokens[request.row] = list(prompt)
        self.live[request.row] = request

    @rule(data=st.data())
    def step(self, data):
        if not self.live:
            return
        rows = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=MAX_ROWS, unique=True))
        requests = [self.live[row] for row in rows]
        targets = [data.draw(st.integers(r.cached_len + 1, r.num_tokens)) for r in requests]
        before = snapshot(self.backend.allocator, requests)
        try:
            self.backend.allocate(requests, targets)
        except OutOfMemoryError:
            assert_same(before, snapshot(self.backend.allocator, requests))
            return
        for request in requests:
            self._forward(request)
        done = [r for r in requests if r.device_len == r.num_tokens]
        for request in requests:
            if request not in done:
                self.backend.cache_unfinished(request)
        appendable = [r for r in done if r.num_tokens < MAX_SEQ_LEN]
        sampled = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(appendable), max_size=len(appendable)))
        self.backend.append_tokens(appendable, torch.tensor(sampled, dtype=torch.int32))
        for request, token in zip(appendable, sampled):
            self.tokens[request.row].append(token)
        for request in done:
            if request not in appendable:
                self._finish(request, computed=True)

    @rule(data=st.data(), lazy=st.booleans())
    def finish(self, data, lazy):
        if not self.live:
            return
        rows = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=2, unique=True))
        if lazy:
            # a scheduling step: finish, then admit into the freed row and grow, before the frees land
            with self.backend.lazy_free():
                for row in rows:
                    self._finish(self.live[row])
                self.backend.check_integrity()
                self.admit(data.draw(st.integers(0, 2)), data.draw(st.integers(0, 40)), [1])
                self.step(data)
        else:
            for row in rows:
                self._finish(self.live[row])

    # ------------------------------------------------------------------ invariants
    @invariant()
    def memory_is_consistent(self):
        backend = self.backend
        backend.check_integrity()
        dummy_start = backend.num_pages * self.page_size
        assert all(start % self.page_size == 0 and start < dummy_start for start in backend.allocator.free_page_starts.tolist())
        for row, request in self.live.items():
            tokens = self.tokens[row]
            assert request.num_tokens == len(tokens)
            assert backend.token_pool[row, : len(tokens)].tolist() == tokens
            locations = backend.page_table[row, : request.cached_len].long()
            assert int(locations.max(0).values) < dummy_start if locations.numel() else True
            assert self.kv[locations].tolist() == prefix_hashes(tokens)[: request.cached_len]
        stats = backend.stats()
        assert stats.free_pages + stats.used_pages == stats.num_pages
        assert stats.running_requests == len(self.live)

    # ------------------------------------------------------------------ helpers
    def _forward(self, request) -> None:
        locations = self.backend.page_table[request.row, request.cached_len : request.device_len].long()
        hashes = prefix_hashes(self.tokens[request.row])[request.cached_len : request.device_len]
        self.kv[locations] = torch.tensor(hashes, dtype=torch.int64)

    def _finish(self, request, computed: bool = False) -> None:
        self.backend.finish(request, computed=computed)
        del self.live[request.row]
        del self.tokens[request.row]


CONFIGS = [(kind, size) for kind in ("radix", "dict", "naive") for size in (1, 4, 16)]


def _run(cache_kind: str, page_size: int, examples: int, steps: int) -> None:
    machine = type(
        f"Lifecycle_{cache_kind}_{page_size}", (LifecycleMachine,), {"cache_kind": cache_kind, "page_size": page_size}
    )
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


@pytest.mark.parametrize("cache_kind,page_size", CONFIGS)
def test_random_lifecycles_conserve_memory(cache_kind, page_size):
    _run(cache_kind, page_size, examples=25 if cache_kind == "radix" else 8, steps=40)


@pytest.mark.slow
@pytest.mark.parametrize("cache_kind,page_size", CONFIGS)
def test_long_random_lifecycles_conserve_memory(cache_kind, page_size):
    _run(cache_kind, page_size, examples=100, steps=100)
