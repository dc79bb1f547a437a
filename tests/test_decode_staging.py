"""DecodeStager's page lists on the torch path (the decode-step kernel's reference on the GPU)
and the host arrays plan() takes, on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.attention.decode_staging import DecodeStager, StagedDecodeBatch
from kvplug.attention.paged_indices import write_page_list_arrays
from kvplug.memory.allocator import NewPages


def reference_page_lists(table: torch.Tensor, rows, device_lens, view_page_size: int):
    """Per request, every S-th entry of its row up to its length, over S; the CSR of them."""
    lists = [table[row, : device_len : view_page_size] // view_page_size for row, device_len in zip(rows, device_lens)]
    indptr = np.concatenate([[0], np.cumsum([len(pages) for pages in lists])])
    last = [(device_len - 1) % view_page_size + 1 for device_len in device_lens]
    return torch.cat(lists), indptr, last


@settings(max_examples=200, deadline=None)
@given(
    lens=st.lists(st.integers(1, 5000), min_size=0, max_size=40),
    view_page_size=st.sampled_from([1, 2, 5, 16, 64]),
    give_positions=st.booleans(),
)
def test_page_list_arrays_match_their_definition(lens, view_page_size, give_positions):
    device_lens = np.array(lens, dtype=np.int32)
    indptr, last = np.full(len(lens) + 1, -7, dtype=np.int32), np.full(len(lens), -7, dtype=np.int32)
    positions = device_lens - 1 if give_positions else None
    indptr[0] = 0
    total = write_page_list_arrays(device_lens, view_page_size, indptr[1:], last, positions)
    pages = [-(-n // view_page_size) for n in lens]
    assert indptr.tolist() == [0, *np.cumsum(pages, dtype=np.int64).tolist()]
    assert last.tolist() == [(n - 1) % view_page_size + 1 for n in lens]
    assert total == sum(pages)
    if view_page_size == 1:  # the token view may leave a last-page array of ones alone
        assert write_page_list_arrays(device_lens, 1, indptr[1:], None) == total


@pytest.mark.parametrize("page_size, list_size", [(1, 1), (16, 1), (16, 16), (5, 5)])
@pytest.mark.parametrize("with_pages", [False, True])
def test_staged_page_lists_equal_the_rows_they_describe(page_size, list_size, with_pages):
    """Page lists staged with a batch equal the table rows read per request - after the step's
    deferred pages went in (a new page starts the request's last view page) - through ring reuse
    and batch sizes that change."""
    rng = np.random.default_rng(page_size * 10 + list_size + with_pages)
    num_rows, width = 40, 160
    table = torch.from_numpy(rng.integers(0, 1 << 20, (num_rows, width)).astype(np.int32) * page_size)
    stager = DecodeStager(table, torch.zeros_like(table), page_size=page_size, page_list_size=list_size, use_kernel=False)
    storage = torch.from_numpy(rng.permutation(512).astype(np.int32) * page_size)
    for bs in (1, 5, 39, 5, 17, 1):
        rows = rng.permutation(num_rows - 1)[:bs]
        cached = rng.integers(0, width // page_size, bs) * page_size + (0 if with_pages else rng.integers(0, page_size, bs))
        deferred = None
        if with_pages:
            page_slot = np.where(rng.random(bs) < 0.6, rng.permutation(512)[:bs], -1).astype(np.int32)
            deferred = NewPages(np.where(page_slot >= 0, storage.numpy()[page_slot], -1).astype(np.int32))
        batch = stager.stage(rows, cached, pages=deferred)
        assert isinstance(batch, StagedDecodeBatch) and batch.page_lists.view_page_size == list_size
        indices, indptr, last = reference_page_lists(table, rows, cached + 1, list_size)
        assert torch.equal(batch.page_lists.indices, indices)
        assert batch.page_lists.indptr.tolist() == indptr.tolist()
        assert batch.page_lists.last_page_len.tolist() == last
        if with_pages:  # the lists hold each new page where it starts the last view page
            growing = deferred.page_start >= 0
            last_entries = batch.page_lists.indices[torch.from_numpy(indptr[1:] - 1)]
            expected = torch.from_numpy(deferred.page_start[growing]) // list_size
            assert torch.equal(last_entries[torch.from_numpy(growing)], expected)


def test_a_stager_without_page_lists_stages_none():
    table = torch.arange(4 * 8, dtype=torch.int32).view(4, 8)
    batch = DecodeStager(table, table + 100, use_kernel=False).stage(np.array([2, 0]), np.array([3, 6]))
    assert isinstance(batch, StagedDecodeBatch) and batch.page_lists is None
    assert batch.out_loc.tolist() == [19, 6]
    assert batch.input_ids.tolist() == [119, 106]  # the token pool at each request's new token
    assert batch.append_index.tolist() == [20, 7]


def test_pending_tokens_go_into_the_token_pool_and_are_the_input_ids():
    table = torch.arange(4 * 8, dtype=torch.int32).view(4, 8)
    tokens = torch.zeros_like(table)
    stager = DecodeStager(table, tokens, use_kernel=False)
    batch = stager.stage(np.array([2, 0]), np.array([3, 6]), tokens=torch.tensor([7, 9], dtype=torch.int32))
    assert batch.input_ids.tolist() == [7, 9]
    assert tokens[2, 3] == 7 and tokens[0, 6] == 9 and int(tokens.count_nonzero()) == 2
    assert stager.stage(np.array([0]), np.array([6])).input_ids.tolist() == [9]


def test_a_padded_stage_fills_a_fixed_buffer_with_the_dummy_request():
    table = torch.arange(5 * 8, dtype=torch.int32).view(5, 8)
    tokens = torch.arange(5 * 8, dtype=torch.int32).view(5, 8) + 100
    stager = DecodeStager(table, tokens, use_kernel=False)
    first = stager.stage(np.array([2, 0]), np.array([3, 6]), pad_to=4, tokens=torch.tensor([1, 2], dtype=torch.int32))
    assert first.table_rows.tolist() == [2, 0, 4, 4] and first.num_padded == 2
    assert first.positions.tolist() == [3, 6, 0, 0] and first.device_lens_cpu.tolist() == [4, 7, 1, 1]
    assert first.out_loc.tolist() == [19, 6, 32, 32] and first.input_ids.tolist() == [1, 2, 132, 132]
    assert tokens[4, 0] == 132  # padding wrote nothing into the token pool
    second = stager.stage(np.array([1]), np.array([2]), pad_to=4)  # another ring slot, the same buffer
    assert second.table_rows.data_ptr() == first.table_rows.data_ptr()
    assert first.table_rows.tolist() == [1, 4, 4, 4]


def test_step_progress_numbers_steps_and_refuses_a_slot_the_device_never_released():
    """Without reports, a ring of 3 hands out steps 1..3 (fresh slots), then the fourth step's
    slot (step 1's) needs step 2 reported: after a sync (nothing is pending on the CPU) at least
    step 3 must be, so a launch that never reports is an error, not a silent sync per step."""
    from kvplug.attention.decode_staging import StepProgress, StepProgressError

    progress = StepProgress(torch.device("cpu"), ring_size=3)
    assert [progress.begin_step() for _ in range(3)] == [1, 2, 3]
    with pytest.raises(StepProgressError, match="expected at least 3"):
        progress.begin_step()
    progress.report(torch.tensor([4], dtype=torch.int32))
    assert progress.reached(2) and progress.reached(4) and not progress.reached(5)
    assert progress.begin_step() == 5


def test_step_progress_compares_numbers_modulo_2_to_the_31():
    from kvplug.attention.decode_staging import StepProgress

    progress = StepProgress(torch.device("cpu"), ring_size=3)
    progress.report(torch.tensor([(1 << 31) - 2], dtype=torch.int32))
    assert progress.reached((1 << 31) - 3) and progress.reached((1 << 31) - 2)
    assert not progress.reached((1 << 31) - 1) and not progress.reached(1 << 31)
    progress.report(torch.tensor([1], dtype=torch.int32))  # step 2**31 + 1, wrapped
    assert progress.reached((1 << 31) + 1) and progress.reached((1 << 31) - 2)


def test_each_stage_reports_its_step_and_batches_keep_their_host_fields_for_a_ring():
    """Every stage's launch (here the torch path) reports its step; a batch's host fields are
    persistent views that stay intact until the stage ``ring_size`` later reuses the slot."""
    table = torch.arange(6 * 32, dtype=torch.int32).view(6, 32)
    stager = DecodeStager(table, torch.zeros_like(table), page_list_size=1, ring_size=2, use_kernel=False)
    first = stager.stage(np.array([1, 4]), np.array([3, 7]))
    assert int(stager.progress.tensor[0]) == 1
    second = stager.stage(np.array([2, 0]), np.array([5, 9]))
    assert int(stager.progress.tensor[0]) == 2
    assert first.device_lens_cpu.tolist() == [4, 8] and first.page_lists.indptr.tolist() == [0, 4, 12]
    third = stager.stage(np.array([3, 5]), np.array([1, 2]))
    assert third.cached_lens_cpu is first.cached_lens_cpu  # slot 0 again: the same views
    assert first.device_lens_cpu.tolist() == [2, 3] and second.device_lens_cpu.tolist() == [6, 10]
    assert third.page_lists.indices.tolist() == [96, 97, 160, 161, 162]


def test_a_one_slot_ring_waits_for_the_previous_step_only():
    table = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    stager = DecodeStager(table, torch.zeros_like(table), ring_size=1, use_kernel=False)
    for step in range(1, 5):
        batch = stager.stage(np.array([2]), np.array([step]))
        assert batch.out_loc.tolist() == [32 + step] and int(stager.progress.tensor[0]) == step


def test_the_torch_page_list_builder_takes_an_empty_batch():
    from kvplug.attention.paged_indices import PagedIndexBuilder

    empty = torch.zeros(0, dtype=torch.int32)
    built = PagedIndexBuilder(torch.zeros(4, 64, dtype=torch.int32), 16, use_kernel=False).build(empty, empty)
    assert built.indices.numel() == 0 and built.indptr.tolist() == [0] and built.last_page_len.numel() == 0
