"""The ``create_backend`` facade: construction, the request lifecycle, statistics, bad input,
and (with the torch attention backend) prefill / prefix reuse / decode against dense attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kvplug
from kvplug.backend import BackendStats, KVBackend, ModelShape, create_backend
from kvplug.backend_factory import resolve_attention
from kvplug.interface import InvalidArgumentError, OutOfMemoryError, UnknownComponentError
from kvplug.memory.capacity import num_pages_for_budget
from tests.test_allocator import DictPrefixCache

SHAPE = ModelShape(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


@pytest.fixture(scope="module")
def manager():
    return kvplug.PluginManager(entry_points=False)


def make_backend(manager, **overrides) -> KVBackend:
    options = dict(page_size=4, num_pages=16, max_running_reqs=4, max_seq_len=64, attention=None, manager=manager)
    options.update(overrides)
    return create_backend(SHAPE, **options)


def run_prefill(backend: KVBackend, request, sampled: int = 1) -> None:
    backend.allocate([request])
    backend.prepare([request], "prefill")
    backend.append_tokens([request], [sampled])


# ---------------------------------------------------------------------- construction


def test_components_have_the_documented_shapes(manager):
    backend = make_backend(manager, prefix_cache="naive")
    assert backend.pool.kv_buffer.shape == (2, 2, 17, 4, 2, 8)
    assert backend.page_table.shape == backend.token_pool.shape == (5, 64)
    assert bool((backend.page_table[4] == 16 * 4).all())  # dummy row -> dummy page
    assert backend.page_size == 4 and backend.num_pages == 16 and backend.max_seq_len == 64
    assert backend.attention is None and backend.attention_name is None


def test_memory_budget_sizes_the_pool(manager):
    backend = make_backend(manager, num_pages=None, memory_budget="1MiB", prefix_cache="naive")
    expected = num_pages_for_budget(SHAPE.kv_bytes_per_token(), 4, 2**20)
    assert backend.num_pages == expected
    assert backend.pool.kv_buffer.numel() * 4 <= 2**20


def test_hf_config_and_dtype_override(manager):
    config = {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 128}
    backend = create_backend(config, num_pages=4, dtype="fp16", attention=None, prefix_cache="naive", manager=manager)
    assert backend.pool.kv_buffer.shape == (2, 3, 5, 1, 4, 16) and backend.pool.dtype == torch.float16


@pytest.mark.parametrize(
    "overrides,error",
    [
        (dict(num_pages=None), InvalidArgumentError),
        (dict(memory_budget="1GiB"), InvalidArgumentError),
        (dict(page_size=0), InvalidArgumentError),
        (dict(tp_size=3), InvalidArgumentError),
        (dict(tp_size=2, tp_rank=2), InvalidArgumentError),
        (dict(max_seq_len=0), InvalidArgumentError),
        (dict(max_running_reqs=0), InvalidArgumentError),
        (dict(prefix_cache="nope"), UnknownComponentError),
        (dict(prefix_cache=DictPrefixCache(8)), InvalidArgumentError),
        (dict(prefix_cache=3), InvalidArgumentError),
        (dict(attention="nope"), UnknownComponentError),
        (dict(device="cuda:0" if not torch.cuda.is_available() else "bogus"), InvalidArgumentError),
    ],
)
def test_bad_construction_arguments(manager, overrides, error):
    with pytest.raises(error):
        make_backend(manager, **overrides)


def test_tensor_parallel_backend_keeps_this_ranks_heads(manager):
    backend = make_backend(manager, tp_size=2, tp_rank=1, prefix_cache="naive")
    assert backend.pool.local_kv_heads == 1


def test_auto_attention_is_torch_on_cpu_and_names_pass_through():
    assert resolve_attention("auto", torch.device("cpu"), ["torch", "triton", "flashinfer"]) == "torch"
    assert resolve_attention("triton", torch.device("cpu"), ["torch"]) == "triton"
    # on CUDA a backend is chosen only if both registered and importable
    assert resolve_attention("auto", torch.device("cuda", 0), ["torch"]) == "torch"


# ---------------------------------------------------------------------- lifecycle and stats


@pytest.mark.parametrize("cache", ["radix", "dict"])
def test_shared_prefix_is_reused_and_counted(manager, cache):
    backend = make_backend(manager, prefix_cache=DictPrefixCache(4) if cache == "dict" else "radix")
    prompt = list(range(100, 118))  # 18 tokens
    first = backend.admit(prompt)
    run_prefill(backend, first)
    first_locations = backend.page_table[first.row, :16].clone()
    backend.finish(first)  # caches 16 tokens (4 pages), frees the 5th page
    second = backend.admit(prompt[:17] + [7, 8])
    assert second.matched_len == 16 and second.cached_len == 16 and second.prefix_len == 16
    assert torch.equal(backend.page_table[second.row, :16], first_locations)
    assert backend.token_pool[second.row, :19].tolist() == prompt[:17] + [7, 8]
    stats = backend.stats()
    assert isinstance(stats, BackendStats)
    assert (stats.queried_tokens, stats.cache_hit_tokens) == (37, 16)
    assert stats.hit_rate == pytest.approx(16 / 37)
    assert (stats.cached_pages, stats.evictable_pages, stats.free_pages) == (4, 0, 12)
    assert (stats.running_requests, stats.admitted_requests, stats.finished_requests) == (1, 2, 1)
    assert stats.utilisation == pytest.approx(4 / 16) and stats.to_json()["used_pages"] == 4
    backend.check_integrity()


def test_decode_steps_append_tokens_and_gather_them_as_input_ids(manager):
    backend = make_backend(manager, prefix_cache="radix")
    request = backend.admit([5, 6, 7])
    backend.allocate([request])
    batch = backend.prepare([request], "prefill")
    assert backend.input_ids(batch).tolist() == [5, 6, 7]
    assert torch.equal(batch.out_loc, backend.page_table[request.row, :3])
    backend.append_tokens([request], torch.tensor([42], dtype=torch.int32))
    for token in (43, 44):
        backend.allocate([request])
        batch = backend.prepare([request], "decode")
        assert backend.input_ids(batch).tolist() == [token - 1]
        assert batch.positions.tolist() == [request.cached_len]
        backend.append_tokens([request], [token])
    assert (request.cached_len, request.num_tokens) == (5, 6)
    assert backend.token_pool[request.row, :6].tolist() == [5, 6, 7, 42, 43, 44]
    backend.finish(request)
    assert backend.stats().cached_pages == 1  # 5 computed tokens -> one full page
    backend.check_integrity()


def test_chunked_prefill_caches_between_chunks(manager):
    backend = make_backend(manager, prefix_cache="radix")
    prompt = list(range(30))
    request = backend.admit(prompt)
    for chunk_end in (8, 16, 24):
        backend.allocate([request], [chunk_end])
        batch = backend.prepare([request], "prefill")
        assert batch.num_tokens == 8
        backend.cache_unfinished(request)
        assert request.prefix_len == chunk_end and request.cached_len == chunk_end
        backend.check_integrity()
    follower = backend.admit(prompt[:20] + [99])
    assert follower.matched_len == 20  # 24 cached, at most len - 1 = 20 matched
    backend.allocate([request])
    backend.append_tokens([request], [1])
    backend.finish(request)
    backend.finish(follower)
    assert backend.stats().running_requests == 0 and backend.stats().cached_pages == 7
    backend.check_integrity()


def test_finish_computed_caches_the_last_forward_and_default_does_not(manager):
    for computed, cached_pages in ((False, 0), (True, 2)):
        backend = make_backend(manager, prefix_cache="radix", max_seq_len=8)
        request = backend.admit(list(range(8)))
        backend.allocate([request])
        backend.prepare([request], "prefill")
        with pytest.raises(InvalidArgumentError, match="max_seq_len"):
            backend.append_tokens([request], [1])  # the row is full
        backend.finish(request, computed=computed)
        assert backend.stats().cached_pages == cached_pages
        backend.check_integrity()


def test_lazy_free_region_defers_frees(manager):
    backend = make_backend(manager, prefix_cache="naive")
    requests = [backend.admit(list(range(8))) for _ in range(2)]
    backend.allocate(requests)
    with backend.lazy_free():
        for request in requests:
            backend.finish(request)
        assert backend.stats().free_pages == 12
    assert backend.stats().free_pages == 16


def test_a_row_reused_inside_a_lazy_region_does_not_change_the_pending_frees(manager):
    backend = make_backend(manager, prefix_cache="naive")
    first = backend.admit(list(range(8)))
    backend.allocate([first])
    with backend.lazy_free():
        backend.finish(first)  # its pages are pending, read from its table row
        second = backend.admit(list(range(20, 28)))
        assert second.row == first.row
        backend.allocate([second])  # overwrites that row with new pages
    backend.check_integrity()
    assert backend.stats().free_pages == 14


# ---------------------------------------------------------------------- bad input


def test_running_out_of_rows_or_pages_changes_nothing(manager):
    backend = make_backend(manager, prefix_cache="radix", max_running_reqs=2, num_pages=4)
    a, b = backend.admit([1, 2, 3]), backend.admit(list(range(20)))
    before = backend.stats()
    with pytest.raises(OutOfMemoryError, match="row"):
        backend.admit([4, 5])
    with pytest.raises(OutOfMemoryError, match="needs 6 pages"):
        backend.allocate([a, b])
    assert backend.stats() == before and a.device_len == 0 and b.allocated_len == 0
    backend.check_integrity()


def test_misuse_is_rejected_before_anything_changes(manager):
    backend = make_backend(manager, prefix_cache="radix")
    request = backend.admit([1, 2, 3, 4, 5])
    bad_calls = {
        "empty prompt": lambda: backend.admit([]),
        "negative id": lambda: backend.admit([1, -2]),
        "float ids": lambda: backend.admit(torch.tensor([1.0, 2.0])),
        "float in a list": lambda: backend.admit([1, 2.5]),
        "string in a list": lambda: backend.admit([1, "2"]),
        "None in a list": lambda: backend.admit([1, None]),
        "bools": lambda: backend.admit([True, False]),
        "nested list": lambda: backend.admit([[1, 2], [3, 4]]),
        "ragged list": lambda: backend.admit([[1, 2], [3]]),
        "id past int32": lambda: backend.admit([1, 2**31]),
        "id past int64": lambda: backend.admit([1, 2**70]),
        "2-D ids": lambda: backend.admit(torch.ones(2, 2, dtype=torch.int32)),
        "prompt too long": lambda: backend.admit(list(range(65))),
        "device_len past known tokens": lambda: backend.allocate([request], [6]),
        "prepare before allocate": lambda: backend.prepare([request], "prefill"),
        "append before a forward": lambda: backend.append_tokens([request], [1]),
        "append count mismatch": lambda: backend.append_tokens([request], [1, 2]),
        "forward without attention": lambda: backend.forward(None, None, None, 0, None),
    }
    for name, call in bad_calls.items():
        snapshot = (backend.stats(), backend.page_table.clone(), backend.token_pool.clone(), request.lengths())
        with pytest.raises(InvalidArgumentError):
            call()
        after = (backend.stats(), backend.page_table.clone(), backend.token_pool.clone(), request.lengths())
        assert snapshot[0] == after[0] and snapshot[3] == after[3], name
        assert torch.equal(snapshot[1], after[1]) and torch.equal(snapshot[2], after[2]), name
    backend.finish(request)
    with pytest.raises(InvalidArgumentError, match="not live"):
        backend.finish(request)
    assert backend.requests.num_live == 0
    backend.check_integrity()


def test_int64_tensors_from_hosts_are_accepted(manager):
    backend = make_backend(manager, prefix_cache="naive")
    request = backend.admit(torch.tensor([3, 1, 2]))
    assert backend.token_pool[request.row, :3].tolist() == [3, 1, 2]


# ---------------------------------------------------------------------- attention end to end


def _qkv(token_ids: torch.Tensor, positions: torch.Tensor, layer: int):
    """Deterministic q/k/v per (token, position, layer), as a model with no cross-token mixing."""
    generator = torch.Generator().manual_seed(1000 + layer)
    tables = [torch.randn(64, heads * SHAPE.head_dim, generator=generator) for heads in (4, 2, 2)]
    position_tables = [torch.randn(64, t.shape[1], generator=generator) for t in tables]
    ids, pos = token_ids.long(), positions.long()
    return [t[ids] + p[pos] for t, p in zip(tables, position_tables)]


def _dense_attention(tokens: list[int], layer: int) -> torch.Tensor:
    q, k, v = _qkv(torch.tensor(tokens), torch.arange(len(tokens)), layer)
    n, d = len(tokens), SHAPE.head_dim
    q, k, v = q.view(n, 4, d).transpose(0, 1), k.view(n, 2, d).transpose(0, 1), v.view(n, 2, d).transpose(0, 1)
    k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(0, 1).reshape(n, 4 * d)


def _step(backend, requests, phase, tokens_of):
    batch = backend.prepare(requests, phase)
    ids = backend.input_ids(batch)
    starts = batch.extend_start_cpu.tolist()
    for layer in range(SHAPE.num_layers):
        q, k, v = _qkv(ids, batch.positions, layer)
        out = backend.forward(q, k, v, layer, batch)
        for i, request in enumerate(requests):
            expected = _dense_attention(tokens_of[request.row][: request.device_len], layer)[request.cached_len :]
            torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, rtol=1e-4, atol=1e-4)


def test_torch_attention_end_to_end_with_prefix_reuse_and_decode(manager):
    pytest.importorskip("kvplug.attention.torch_backend")
    backend = make_backend(manager, attention="auto", prefix_cache="radix")
    assert backend.attention_name == "torch"
    shared = [(7 * i) % 64 for i in range(13)]
    tokens = {}
    first = backend.admit(shared + [1, 2])
    tokens[first.row] = shared + [1, 2]
    backend.allocate([first])
    _step(backend, [first], "prefill", tokens)
    backend.append_tokens([first], [9])
    tokens[first.row].append(9)
    backend.cache_unfinished(first)  # no-op beyond caching: the whole prompt is computed
    second = backend.admit(shared + [3, 4, 5])
    tokens[second.row] = shared + [3, 4, 5]
    assert second.matched_len == 12  # three full pages of the shared prefix, from the first request
    backend.allocate([first, second])
    _step(backend, [second, first], "prefill", tokens)  # an extend batch: 4 new tokens + 1 decode token
    for token in (11, 12, 13):
        backend.append_tokens([first, second], [token, token + 1])
        tokens[first.row].append(token)
        tokens[second.row].append(token + 1)
        backend.allocate([first, second])
        _step(backend, [first, second], "decode", tokens)
    backend.finish(first, computed=True)
    backend.finish(second, computed=True)
    backend.check_integrity()


# ---------------------------------------------------------------------- per-step fast paths


def _backend_with_tables(manager, page_size: int, host_views: bool, prefix_cache: str = "naive", **options) -> KVBackend:
    """A backend whose tables use numpy views (CPU default) or the torch path a GPU takes."""
    import dataclasses

    from kvplug.backend_factory import build_parts
    from kvplug.memory.allocator import PagedAllocator
    from kvplug.memory.page_table import PageTable

    sizes = dict(page_size=page_size, num_pages=6 * 96 // page_size + 6, max_running_reqs=6, max_seq_len=96,
                 memory_budget=None)
    sizes.update(options)
    parts = build_parts(SHAPE, prefix_cache=prefix_cache, attention=None, device="cpu", dtype=None, tp_size=1, tp_rank=0,
                        manager=manager, validate=None, attention_options=None, **sizes)
    tables = PageTable(sizes["max_running_reqs"], sizes["max_seq_len"], dummy_location=parts.pool.dummy_location,
                       device=torch.device("cpu"), host_views=host_views)
    allocator = PagedAllocator(sizes["num_pages"], page_size, tables, parts.prefix_cache)
    return KVBackend(dataclasses.replace(parts, tables=tables, allocator=allocator))


class ReferenceTables:
    """The page table and token pool a backend must hold, one request and one page at a time:
    pages leave a FIFO free list in batch order and return to its end."""

    def __init__(self, backend: KVBackend) -> None:
        size = backend.page_size
        self.size, self.free = size, [page * size for page in range(backend.num_pages)]
        self.table, self.tokens = backend.page_table.clone(), backend.token_pool.clone()
        self.pages: dict[int, list[int]] = {}

    def admit(self, request, prompt: list[int]) -> None:
        self.pages[request.row] = []
        self.tokens[request.row, : len(prompt)] = torch.tensor(prompt, dtype=torch.int32)

    def allocate(self, requests, lengths) -> None:
        for request, length in zip(requests, lengths):
            owned = self.pages[request.row]
            while len(owned) * self.size < length:
                owned.append(self.free.pop(0))
                start = (len(owned) - 1) * self.size
                end = min(start + self.size, self.table.shape[1])  # a page may reach past the row's end
                self.table[request.row, start:end] = torch.arange(owned[-1], owned[-1] + end - start)

    def finish(self, request) -> None:
        self.free += self.pages.pop(request.row)


@pytest.mark.parametrize("host_views", [True, False])
@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_decode_steps_equal_the_general_path_and_a_reference(manager, page_size, host_views):
    """Random chunked prefills, decode steps, finishes and admissions: after every call the page
    table and token pool equal a one-page-at-a-time reference, and every decode batch equals the
    general build of the same batch field for field (so do its ``input_ids``). Rows are 96
    tokens: page 64 is no divisor, so a row's second page is clipped to its end."""
    run_random_decode_steps(_backend_with_tables(manager, page_size, host_views), np.random.default_rng(page_size))


def run_random_decode_steps(backend: KVBackend, rng: np.random.Generator) -> None:
    """The body of the test above, for any backend of 6 rows x 96 tokens (the GPU tests run it
    on CUDA tables)."""
    from kvplug.attention.batch import build_attention_batch
    from kvplug.interface import ForwardPhase
    from tests.test_attention_batch import assert_same_batch

    reference = ReferenceTables(backend)
    running: list = []
    for step in range(60):
        if len(running) < 5 and rng.random() < 0.4:  # admit and prefill, in chunks of up to 20 tokens
            prompt = rng.integers(0, 1000, int(rng.integers(1, 40))).tolist()
            request = backend.admit(prompt)
            reference.admit(request, prompt)
            while request.device_len < len(prompt):
                chunk = min(len(prompt), request.cached_len + int(rng.integers(1, 21)))
                backend.allocate([request], [chunk])
                reference.allocate([request], [chunk])
                backend.prepare([request], "prefill")
                if chunk < len(prompt):
                    backend.cache_unfinished(request)
            backend.append_tokens([request], [int(rng.integers(0, 1000))])
            reference.tokens[request.row, request.num_tokens - 1] = backend.token_pool[request.row, request.num_tokens - 1]
            running.append(request)
        if running and rng.random() < 0.15:  # finish one
            request = running.pop(int(rng.integers(len(running))))
            backend.finish(request, computed=True)
            reference.finish(request)
        running = [r for r in running if r.num_tokens < backend.max_seq_len - 1]
        if not running:
            continue
        order = list(rng.permutation(len(running)))
        batch_requests = [running[i] for i in order]
        explicit = rng.random() < 0.6  # begin_decode / commit, else allocate / prepare / append_tokens
        for _ in range(int(rng.integers(1, 4))):  # a few decode steps over the same list
            rows = [r.row for r in batch_requests]
            cached = [r.cached_len for r in batch_requests]
            reference.allocate(batch_requests, [r.num_tokens for r in batch_requests])
            if explicit:
                step = backend.begin_decode(batch_requests)
                batch, input_ids = step.batch, step.input_ids
            else:
                backend.allocate(batch_requests)
                batch = backend.prepare(batch_requests, "decode")
                input_ids = backend.input_ids(batch)
            general = build_attention_batch(backend.page_table, rows, cached, [c + 1 for c in cached], ForwardPhase.PREFILL)
            assert_same_batch(batch, general)
            assert batch.is_decode
            expected_ids = reference.tokens[torch.tensor(rows), torch.tensor(cached)]
            assert torch.equal(input_ids, expected_ids)
            sampled = torch.tensor(rng.integers(0, 1000, len(rows)), dtype=torch.int32)
            if explicit:
                step.commit(sampled)
            else:
                backend.append_tokens(batch_requests, sampled)
            reference.tokens[torch.tensor(rows), torch.tensor(cached) + 1] = sampled.to(reference.tokens.device)
            assert torch.equal(backend.page_table, reference.table), f"step {step}"
            if rng.random() < 0.3:  # reading the pool writes a pending commit: not every step
                assert torch.equal(backend.token_pool, reference.tokens), f"step {step}"
            batch_requests = [r for r in batch_requests if r.num_tokens < backend.max_seq_len - 1]
            if not batch_requests:
                break
        backend.check_integrity()
    assert torch.equal(backend.token_pool, reference.tokens)


def test_a_repeated_request_list_is_still_checked(manager):
    """The memo behind repeated batches never lets a finished, duplicated or foreign request through."""
    backend = make_backend(manager, prefix_cache="naive")
    a, b = backend.admit([1, 2]), backend.admit([3, 4])
    batch = [a, b]
    backend.allocate(batch)
    backend.prepare(batch, "prefill")
    backend.append_tokens(batch, [5, 6])
    backend.allocate(batch)  # memoised
    backend.allocate(tuple(batch))  # same requests as a tuple
    batch.append(a)  # mutated in place: a duplicate
    with pytest.raises(InvalidArgumentError, match="twice"):
        backend.prepare(batch, "decode")
    batch.pop()
    backend.prepare(batch, "decode")
    backend.finish(b)
    with pytest.raises(InvalidArgumentError, match="not live"):
        backend.append_tokens(batch, [7, 8])
    c = backend.admit([9])  # reuses b's row
    assert c.row == b.row
    with pytest.raises(InvalidArgumentError, match="not live"):
        backend.allocate([a, b])
    other = make_backend(manager, prefix_cache="naive")
    with pytest.raises(InvalidArgumentError, match="not live"):
        other.allocate([a])
    with pytest.raises(InvalidArgumentError, match="phase"):
        backend.prepare([a], "sample")
    backend.finish(c)
    d = backend.admit([1, 2, 3, 4])
    with pytest.raises(InvalidArgumentError, match="call allocate"):
        backend.prepare([d], "prefill")
    backend.allocate([a, d])
    with pytest.raises(InvalidArgumentError, match="exactly one new token"):
        backend.prepare([a, d], "decode")  # d's prefill computes 4 tokens
    assert backend.prepare([a, d], "prefill").num_tokens == 5
    backend.check_integrity()


def test_staged_decode_batches_live_until_the_ring_comes_round(manager):
    """A GPU-path decode batch's device tensors are a ring slot's views: intact through the next
    ``ring_size - 1`` decode prepares (a host may prepare ahead), reused by the one after."""
    backend = _backend_with_tables(manager, 1, host_views=False)
    requests = [backend.admit([1, 2, 3]), backend.admit([4, 5])]
    backend.allocate(requests)
    backend.prepare(requests, "prefill")
    backend.append_tokens(requests, [6, 7])
    ring = backend.stager.ring_size
    assert ring >= 2
    batches, snapshots = [], []
    for _ in range(ring + 1):
        backend.allocate(requests)
        batch = backend.prepare(requests, "decode")
        batches.append(batch)
        snapshots.append(batch.cached_lens.clone())
        for earlier, snapshot in zip(batches[-ring:], snapshots[-ring:]):
            assert torch.equal(earlier.cached_lens, snapshot)
        backend.append_tokens(requests, [8, 9])
    assert batches[0].cached_lens.data_ptr() == batches[ring].cached_lens.data_ptr()
    assert not torch.equal(batches[0].cached_lens, snapshots[0])  # the slot came round
    assert batches[1].cached_lens.data_ptr() != batches[0].cached_lens.data_ptr()


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_gpu_path_decode_steps_stay_exact_under_prefix_hits_and_evictions(manager, page_size, explicit):
    """The torch-table (GPU) decode path with the radix cache in a pool small enough to evict,
    call by call or as explicit steps (``begin_decode`` / ``commit``): every decode batch's
    out_loc is the table's cell for the new token, input ids are the pool's tokens (the previous
    step's sampled ids), and integrity holds after every step."""
    rng = np.random.default_rng(page_size)
    backend = _backend_with_tables(manager, page_size, host_views=False, prefix_cache="radix",
                                   num_pages=200 // page_size)
    prefixes = [rng.integers(0, 1000, 24).tolist() for _ in range(3)]
    running: list = []
    expected_next: dict[int, int] = {}
    for step in range(120):
        if len(running) < 5 and rng.random() < 0.5:
            prompt = prefixes[int(rng.integers(3))] + rng.integers(0, 1000, int(rng.integers(1, 12))).tolist()
            request = backend.admit(prompt)  # a row is free: at most 5 of 6 are live
            try:
                first = int(rng.integers(0, 1000))
                run_prefill(backend, request, first)
                running.append(request)
                expected_next[request.row] = first
            except OutOfMemoryError:
                backend.finish(request)
        if running and (rng.random() < 0.2 or len(running) == 5):
            backend.finish(running.pop(int(rng.integers(len(running)))), computed=False)
        running = [r for r in running if r.num_tokens < backend.max_seq_len - 1]
        if not running:
            continue
        try:
            if explicit:
                decode_step = backend.begin_decode(running)
                batch, input_ids = decode_step.batch, decode_step.input_ids
            else:
                backend.allocate(running)
                batch = backend.prepare(running, "decode")
                input_ids = backend.input_ids(batch)
        except OutOfMemoryError:
            backend.finish(running.pop(0))
            continue
        rows = torch.tensor([r.row for r in running])
        cached = torch.tensor([r.cached_len for r in running])
        assert torch.equal(batch.out_loc, backend.page_table[rows, cached]), f"step {step}"
        assert input_ids.tolist() == [expected_next[r.row] for r in running]
        sampled = torch.tensor(rng.integers(0, 1000, len(running)), dtype=torch.int32)
        if explicit:
            decode_step.commit(sampled)
        else:
            backend.append_tokens(running, sampled)
        expected_next.update({r.row: int(t) for r, t in zip(running, sampled)})
        assert torch.equal(backend.token_pool[rows, cached + 1], sampled)
        backend.check_integrity()
    stats = backend.stats()
    assert stats.evicted_tokens > 0 and stats.cache_hit_tokens > 0


# ---------------------------------------------------------------------- host-known ids, lookups


def test_only_host_known_ids_are_cached_until_the_host_reports_them(manager):
    """Sampled ids that stay on the device (emulated: the table forgets they were known) are not
    keys of the prefix cache; ``finish(tokens=...)`` reports them and they are cached."""
    backend = make_backend(manager, page_size=4)
    for report in (False, True):
        prompt = [50 + int(report)] + list(range(1, 8))  # 8 ids: two pages
        request = backend.admit(prompt)
        run_prefill(backend, request, sampled=9)
        for sampled in (10, 11, 12, 13):
            step = backend.begin_decode([request])
            step.commit([sampled])
        backend.requests.know(request.row, request.prompt_len)  # as if every sampled id stayed on a GPU
        assert request.known_len == 8 and request.cached_len == 12
        generated = [9, 10, 11, 12, 13]
        backend.finish(request, tokens=prompt + generated if report else None)
        follow_up = backend.admit(prompt + generated + [99])
        assert follow_up.matched_len == (12 if report else 8)
        backend.finish(follow_up)
    backend.check_integrity()


def test_record_tokens_refuses_ids_that_contradict_the_known_ones(manager):
    backend = make_backend(manager, page_size=4)
    request = backend.admit([1, 2, 3, 4, 5])
    before = request.lengths()
    for wrong in ([1, 2, 3], [1, 2, 3, 4, 6]):
        with pytest.raises(InvalidArgumentError, match="do not start with"):
            backend.record_tokens(request, wrong)
        assert request.lengths() == before
    backend.record_tokens(request, [1, 2, 3, 4, 5, 6, 7])  # past num_tokens: ignored
    assert request.known_len == 5
    backend.finish(request)


def test_a_lookup_is_matched_once_and_again_only_after_the_cache_changed(manager, monkeypatch):
    backend = make_backend(manager, page_size=4)
    first = backend.admit(list(range(9)))
    run_prefill(backend, first)
    backend.finish(first)
    calls = []
    cache = backend.prefix_cache
    for name in ("match_prefix", "match_host"):  # the allocator hands the built-in radix host arrays
        original = getattr(cache, name)
        monkeypatch.setattr(cache, name, lambda ids, original=original: calls.append(len(ids)) or original(ids))
    lookup = backend.lookup(list(range(9)) + [100])
    assert lookup.cached_len == 8 and calls == [9]
    request = backend.admit(lookup)  # the lookup's match: no second one
    assert request.matched_len == 8 and calls == [9]
    backend.finish(request)  # inserts: later lookups are stale
    stale = backend.lookup(list(range(9)) + [101])
    other = backend.admit([7, 7, 7, 7, 7])
    run_prefill(backend, other)
    backend.finish(other)
    again = backend.admit(stale)
    assert again.matched_len == 8 and calls == [9, 9, 4, 9]
    unmatched = backend.admit(list(range(9)) + [102], match=False)
    assert unmatched.matched_len == 0 and calls == [9, 9, 4, 9, 0]
    backend.finish(again)
    backend.finish(unmatched)
    backend.check_integrity()
