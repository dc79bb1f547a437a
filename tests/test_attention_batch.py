"""``build_attention_batch`` and the device-side page-list builder, against plain Python models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.attention.batch import build_attention_batch, build_decode_batch
from tests.attention_reference import one_torch_thread  # noqa: F401 (autouse fixture)
from kvplug.attention.paged_indices import PagedIndexBuilder
from kvplug.interface import ForwardPhase, InvalidArgumentError

NUM_ROWS, WIDTH = 9, 64  # 8 request rows + the dummy row


def random_table(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10_000, (NUM_ROWS, WIDTH), generator=gen, dtype=torch.int32)


def model_batch(table, rows, cached, device):
    """What the batch must hold, computed the obvious way, one request at a time."""
    out_loc, positions, starts = [], [], [0]
    for row, c, d in zip(rows, cached, device):
        out_loc += table[row, c:d].tolist()
        positions += list(range(c, d))
        starts.append(starts[-1] + d - c)
    return out_loc, positions, starts


def test_example_prefill_batch():
    table = random_table()
    batch = build_attention_batch(table, [3, 0], [2, 0], [5, 1], ForwardPhase.PREFILL)
    assert batch.positions.tolist() == [2, 3, 4, 0]
    assert batch.out_loc.tolist() == table[3, 2:5].tolist() + [int(table[0, 0])]
    assert batch.extend_start.tolist() == [0, 3, 4]
    assert batch.extend_start_cpu.tolist() == [0, 3, 4]
    assert batch.table_rows.tolist() == [3, 0]
    assert batch.cached_lens_cpu.tolist() == [2, 0] and batch.device_lens_cpu.tolist() == [5, 1]
    assert batch.batch_size == 2 and batch.num_tokens == 4 and not batch.is_decode
    for name in ("table_rows", "cached_lens", "device_lens", "extend_start", "positions", "out_loc"):
        assert getattr(batch, name).dtype == torch.int32, name
    assert batch.page_table is table and batch.metadata is None


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    bs=st.integers(1, 8),
    decode=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_batch_matches_model(data, bs, decode, seed):
    table = random_table(seed)
    rows = data.draw(st.permutations(range(NUM_ROWS - 1)))[:bs]
    cached = data.draw(st.lists(st.integers(0, WIDTH - 1), min_size=bs, max_size=bs))
    if decode:
        device = [c + 1 for c in cached]
    else:
        device = [data.draw(st.integers(c + 1, WIDTH)) for c in cached]
    as_tensor = data.draw(st.booleans())
    args = [torch.tensor(x, dtype=torch.int32) if as_tensor else x for x in (rows, cached, device)]
    phase = ForwardPhase.DECODE if decode else ForwardPhase.PREFILL
    batch = build_attention_batch(table, *args, phase)
    out_loc, positions, starts = model_batch(table, rows, cached, device)
    assert batch.out_loc.tolist() == out_loc
    assert batch.positions.tolist() == positions
    assert batch.extend_start.tolist() == starts == batch.extend_start_cpu.tolist()
    assert batch.cached_lens.tolist() == cached == batch.cached_lens_cpu.tolist()
    assert batch.device_lens.tolist() == device == batch.device_lens_cpu.tolist()
    assert batch.table_rows.tolist() == rows


def test_batches_do_not_share_host_memory():
    table = random_table()
    first = build_attention_batch(table, [1], [3], [4], ForwardPhase.DECODE)
    build_attention_batch(table, [2], [7], [8], ForwardPhase.DECODE)
    assert first.cached_lens_cpu.tolist() == [3] and first.device_lens_cpu.tolist() == [4]


def test_padded_requests_use_the_dummy_row():
    table = random_table()
    batch = build_attention_batch(table, [4, 8, 8], [5, 0, 0], [6, 1, 1], ForwardPhase.DECODE, num_padded=2)
    assert batch.num_padded == 2
    assert batch.out_loc.tolist() == [int(table[4, 5]), int(table[8, 0]), int(table[8, 0])]
    with pytest.raises(InvalidArgumentError, match="dummy row"):
        build_attention_batch(table, [4, 5], [5, 0], [6, 1], ForwardPhase.DECODE, num_padded=1)


@pytest.mark.parametrize(
    "rows, cached, device, phase, message",
    [
        ([1, 2], [0], [1, 1], ForwardPhase.PREFILL, "same non-zero length"),
        ([], [], [], ForwardPhase.PREFILL, "same non-zero length"),
        ([9], [0], [1], ForwardPhase.PREFILL, r"\[0, 8\)"),
        ([8], [0], [1], ForwardPhase.PREFILL, "dummy"),
        ([-1], [0], [1], ForwardPhase.PREFILL, r"\[0, 8\)"),
        ([2, 2], [0, 0], [1, 1], ForwardPhase.PREFILL, "twice"),
        ([2], [-1], [1], ForwardPhase.PREFILL, "cached_len=-1"),
        ([2], [4], [4], ForwardPhase.PREFILL, "cached_len=4, device_len=4"),
        ([2], [4], [WIDTH + 1], ForwardPhase.PREFILL, f"row width {WIDTH}"),
        ([2, 3], [4, 0], [5, 2], ForwardPhase.DECODE, "request 1 has cached_len=0, device_len=2"),
        ([2.5], [0], [1], ForwardPhase.PREFILL, "integers"),
    ],
)
def test_bad_lengths_and_rows_are_rejected(rows, cached, device, phase, message):
    table = random_table()
    before = table.clone()
    with pytest.raises(InvalidArgumentError, match=message):
        build_attention_batch(table, rows, cached, device, phase)
    assert torch.equal(table, before)


def test_bad_table_and_phase_are_rejected():
    with pytest.raises(InvalidArgumentError, match="int32"):
        build_attention_batch(random_table().long(), [0], [0], [1], ForwardPhase.PREFILL)
    with pytest.raises(InvalidArgumentError, match="ForwardPhase"):
        build_attention_batch(random_table(), [0], [0], [1], "decode")
    with pytest.raises(InvalidArgumentError, match="host values"):
        build_attention_batch(random_table(), torch.tensor([0], device="meta"), [0], [1], ForwardPhase.PREFILL)


@pytest.mark.parametrize("view_page_size", [1, 4, 16])
def test_paged_indices_match_per_request_slicing(view_page_size):
    gen = torch.Generator().manual_seed(view_page_size)
    table = torch.randint(0, 1 << 20, (NUM_ROWS, WIDTH), generator=gen, dtype=torch.int32)
    rows = [5, 0, 7, 2]
    lens = [1, view_page_size, WIDTH, 37]
    built = PagedIndexBuilder(table, view_page_size).build(
        torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    )
    expected_indices, expected_indptr, expected_last = [], [0], []
    for row, length in zip(rows, lens):
        pages = -(-length // view_page_size)
        expected_indices += (table[row, : pages * view_page_size : view_page_size] // view_page_size).tolist()
        expected_indptr.append(expected_indptr[-1] + pages)
        expected_last.append(length - (pages - 1) * view_page_size)
    assert built.indices.tolist() == expected_indices
    assert built.indptr.tolist() == expected_indptr
    assert built.last_page_len.tolist() == expected_last
    assert built.indices.dtype == built.indptr.dtype == built.last_page_len.dtype == torch.int32


@pytest.mark.parametrize("view_page_size", [1, 4, 16])
def test_kernel_path_host_side_matches_the_torch_path(view_page_size):
    """The host-side indptr / last-page lengths of the GPU (kernel) path, with the kernel replaced
    by the torch path's gather, so CPU CI checks them; the kernel itself is tested on the GPU."""
    gen = torch.Generator().manual_seed(view_page_size)
    table = torch.randint(0, 1 << 20, (NUM_ROWS, WIDTH), generator=gen, dtype=torch.int32)
    rows, lens = torch.tensor([5, 0, 7, 2], dtype=torch.int32), torch.tensor([1, view_page_size, WIDTH, 37], dtype=torch.int32)
    reference = PagedIndexBuilder(table, view_page_size, use_kernel=False)
    expected = reference.build(rows, lens)
    calls = []

    def fake_kernel(table_rows, device_lens, total_pages):
        calls.append((total_pages, device_lens.tolist()))
        return expected.indices

    kernel_path = PagedIndexBuilder(table, view_page_size, use_kernel=False)
    kernel_path._kernel = fake_kernel
    built = kernel_path.build(rows, lens)
    assert calls == [(int(expected.indptr[-1]), lens.tolist())]
    assert built.indptr.tolist() == expected.indptr.tolist()
    assert built.last_page_len.tolist() == expected.last_page_len.tolist()
    assert built.indptr.dtype == built.last_page_len.dtype == torch.int32


def test_validation_can_be_skipped_by_a_trusted_caller():
    table = random_table()
    batch = build_attention_batch(table, [3, 0], [2, 0], [5, 1], ForwardPhase.PREFILL, validate=False)
    assert batch.out_loc.tolist() == table[3, 2:5].tolist() + [int(table[0, 0])]
    with pytest.raises(InvalidArgumentError):
        build_attention_batch(table, [3, 3], [2, 0], [5, 1], ForwardPhase.PREFILL)


# ---------------------------------------------------------------------- decode fast path

BATCH_FIELDS = ("table_rows", "cached_lens", "device_lens", "cached_lens_cpu", "device_lens_cpu", "extend_start",
                "extend_start_cpu", "positions", "out_loc")


def assert_same_batch(fast, general) -> None:
    for name in BATCH_FIELDS:
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype == torch.int32 and a.device == b.device and torch.equal(a, b), name
    assert fast.page_table is general.page_table and fast.num_padded == general.num_padded


@settings(max_examples=60, deadline=None)
@given(data=st.data(), bs=st.integers(1, NUM_ROWS - 1), seed=st.integers(0, 2**16), how=st.sampled_from(
    ["none", "tensor", "numpy"]), pass_starts=st.booleans())
def test_decode_fast_path_equals_the_general_path(data, bs, seed, how, pass_starts):
    """Every field of ``build_decode_batch`` equals the general (prefill-layout) build of the
    same one-token-per-request batch, whichever way the flat table is given."""
    table = random_table(seed)
    rows = np.array(data.draw(st.permutations(range(NUM_ROWS - 1)))[:bs], dtype=np.int64)
    cached = np.array(data.draw(st.lists(st.integers(0, WIDTH - 1), min_size=bs, max_size=bs)), dtype=np.int64)
    flat = {"none": None, "tensor": table.view(-1), "numpy": table.view(-1).numpy()}[how]
    starts = rows * WIDTH if pass_starts else None
    fast = build_decode_batch(table, rows, cached, flat_table=flat, row_starts=starts)
    general = build_attention_batch(table, rows, cached, cached + 1, ForwardPhase.PREFILL)
    assert fast.phase is ForwardPhase.DECODE and general.phase is ForwardPhase.PREFILL
    assert_same_batch(fast, general)
    assert_same_batch(build_attention_batch(table, rows, cached, cached + 1, ForwardPhase.DECODE), general)


def test_decode_fast_path_keeps_padding_and_fresh_buffers():
    table = random_table()
    flat = table.view(-1).numpy()
    rows, cached = np.array([4, 8, 8]), np.array([5, 0, 0])
    first = build_decode_batch(table, rows, cached, num_padded=2, flat_table=flat)
    expected = build_attention_batch(table, rows, cached, cached + 1, ForwardPhase.DECODE, num_padded=2)
    assert_same_batch(first, expected)
    assert first.num_padded == 2 and first.is_decode
    build_decode_batch(table, np.array([1]), np.array([9]), flat_table=flat)
    assert first.cached_lens_cpu.tolist() == [5, 0, 0] and first.out_loc.tolist() == expected.out_loc.tolist()
