"""The GPU decode stager (one Triton launch) equals the general batch build field for field, with
the input ids and append index it derives, over random batches, padding and the ring's slot
reuse. Skipped without CUDA/Triton."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplug.attention.batch import build_attention_batch
from kvplug.attention.decode_staging import DecodeStager
from kvplug.attention.paged_indices import PagedIndexBuilder
from kvplug.interface import ForwardPhase
from tests.attention_reference import importable, requires_cuda
from tests.test_attention_batch import assert_same_batch

pytestmark = [
    pytest.mark.gpu,
    requires_cuda,
    pytest.mark.skipif(not importable("triton"), reason="needs triton (pip install -e \".[triton]\")"),
]


@pytest.mark.parametrize("use_kernel", [True, False])
def test_stager_equals_the_general_build(use_kernel):
    rng = np.random.default_rng(int(use_kernel))
    num_rows, width = 301, 4096
    table = torch.randint(0, 1 << 28, (num_rows, width), dtype=torch.int32, device="cuda")
    tokens = torch.randint(0, 1 << 17, (num_rows, width), dtype=torch.int32, device="cuda")
    stager = DecodeStager(table, tokens, use_kernel=use_kernel)
    for bs in (1, 2, 255, 256, 257, 300, 7, 1):  # new sizes and repeats, so slots come round
        rows = rng.permutation(num_rows - 1)[:bs].astype(np.int64)
        cached = rng.integers(0, width - 1, bs)
        batch = stager.stage(rows, cached)
        general = build_attention_batch(table, rows, cached, cached + 1, ForwardPhase.PREFILL)
        assert_same_batch(batch, general)
        cells = torch.from_numpy(rows * width + cached).cuda()
        assert torch.equal(batch.input_ids, tokens.view(-1)[cells])
        assert batch.append_index.dtype == torch.int64 and torch.equal(batch.append_index, cells + 1)
        assert np.array_equal(batch.device_lens_cpu.numpy(), cached + 1)


def test_a_one_slot_ring_reuses_its_views_with_each_steps_values():
    """With one slot every step reuses the same views, and each step's copy and kernel (ordered
    on the stream) leave that step's values in them."""
    table = torch.arange(9 * 64, dtype=torch.int32, device="cuda").view(9, 64)
    stager = DecodeStager(table, torch.zeros_like(table), ring_size=1)
    rows, cached = np.array([3, 1], dtype=np.int64), np.array([5, 9], dtype=np.int64)
    first = stager.stage(rows, cached)
    assert first.out_loc.tolist() == [3 * 64 + 5, 64 + 9]
    second = stager.stage(rows, cached + 1)
    assert second.out_loc is first.out_loc  # one slot: the same views
    assert second.out_loc.tolist() == [3 * 64 + 6, 64 + 10]


@pytest.mark.parametrize("page_size", [1, 5, 16, 64])
def test_kernel_writes_new_pages_like_the_torch_path(page_size):
    """New pages written by the kernel equal the torch path's writes (page 5: pages clipped at a
    row end that 5 does not divide), and out_loc is each new page."""
    from kvplug.memory.allocator import NewPages

    rng = np.random.default_rng(page_size)
    num_rows, width = 301, 4096
    kernel_table = torch.randint(0, 1 << 28, (num_rows, width), dtype=torch.int32, device="cuda")
    torch_table = kernel_table.clone()
    storage = (torch.randperm(4096) * page_size).to(torch.int32).numpy()
    kernel_stager = DecodeStager(kernel_table, torch.zeros_like(kernel_table), page_size=page_size, use_kernel=True)
    torch_stager = DecodeStager(torch_table, torch.zeros_like(torch_table), page_size=page_size, use_kernel=False)
    for bs in (1, 7, 256, 300, 7):
        rows = rng.permutation(num_rows - 1)[:bs].astype(np.int64)
        cached = rng.integers(0, width // page_size, bs) * page_size
        cached[0] = width - 1 if page_size > 1 else cached[0]  # a page reaching past the row's end
        page_slot = np.where(rng.random(bs) < 0.6, rng.permutation(4096)[:bs], -1).astype(np.int32)
        pages = NewPages(np.where(page_slot >= 0, storage[page_slot], -1).astype(np.int32))
        by_kernel = kernel_stager.stage(rows, cached, pages=pages)
        by_torch = torch_stager.stage(rows, cached, pages=pages)
        assert torch.equal(kernel_table, torch_table), bs
        for name in ("out_loc", "table_rows", "cached_lens", "device_lens", "append_index"):
            assert torch.equal(getattr(by_kernel, name), getattr(by_torch, name)), name
        growing = torch.from_numpy(page_slot >= 0).cuda()
        assert torch.equal(by_kernel.out_loc[growing], torch.from_numpy(pages.page_start[page_slot >= 0]).cuda())


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_backend_on_cuda_tables_matches_a_reference_through_random_steps(page_size):
    """KVBackend on CUDA (its decode pages written by the stager's launch): random prefills,
    decode steps, finishes and admissions keep the page table and token pool equal to a
    one-page-at-a-time reference (the CPU suite's test, on the GPU path)."""
    import kvplug
    from kvplug.memory.model_shape import ModelShape
    from tests.test_backend import run_random_decode_steps

    shape = ModelShape(num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=8, dtype=torch.float16)
    backend = kvplug.create_backend(
        shape, page_size=page_size, num_pages=6 * 96 // page_size + 6, max_running_reqs=6, max_seq_len=96,
        prefix_cache="naive", attention=None, device="cuda",
    )
    run_random_decode_steps(backend, np.random.default_rng(page_size))


@pytest.mark.parametrize("page_size, list_size", [(1, 1), (16, 1), (16, 16), (64, 64), (5, 5)])
@pytest.mark.parametrize("with_pages", [False, True])
def test_kernel_page_lists_equal_the_torch_path(page_size, list_size, with_pages):
    """The page lists the decode-step launch writes equal the torch path's (PagedIndexBuilder over
    the table after the new pages went in), with the batch fields and table writes, through
    ring reuse, batch sizes that change, padding to a graph's size and page-list buffers that
    grow (short rows first)."""
    from kvplug.memory.allocator import NewPages

    rng = np.random.default_rng(page_size * 100 + list_size * 2 + with_pages)
    num_rows, width = 301, 4096
    kernel_table = (torch.randint(0, 1 << 20, (num_rows, width), dtype=torch.int32, device="cuda") * page_size)
    torch_table = kernel_table.clone()
    kernel_tokens = torch.randint(0, 1 << 17, (num_rows, width), dtype=torch.int32, device="cuda")
    torch_tokens = kernel_tokens.clone()
    storage = (torch.randperm(8192) * page_size).to(torch.int32).numpy()
    stagers = [
        DecodeStager(table, tokens, page_size=page_size, page_list_size=list_size, use_kernel=use_kernel)
        for table, tokens, use_kernel in ((kernel_table, kernel_tokens, True), (torch_table, torch_tokens, False))
    ]
    for step, (bs, longest) in enumerate([(1, 40), (7, 40), (256, 300), (300, width), (7, width), (1, width), (256, width)]):
        rows = rng.permutation(num_rows - 1)[:bs].astype(np.int64)
        cached = rng.integers(0, max(1, longest // page_size), bs) * page_size
        if not with_pages:
            cached = np.minimum(cached + rng.integers(0, page_size, bs), width - 1)
        pages = None
        if with_pages:
            page_slot = np.where(rng.random(bs) < 0.6, rng.permutation(8192)[:bs], -1).astype(np.int32)
            pages = NewPages(np.where(page_slot >= 0, storage[page_slot], -1).astype(np.int32))
        # odd steps carry pending tokens (written into the token pool; they are the input ids)
        values = torch.randint(0, 1 << 17, (bs,), dtype=torch.int32, device="cuda") if step % 2 else None
        pad_to = bs + 3 if step % 3 == 2 else None  # staged into a graph's fixed buffer, dummy-padded
        by_kernel, by_torch = (stager.stage(rows, cached, pages=pages, tokens=values, pad_to=pad_to) for stager in stagers)
        assert torch.equal(kernel_table, torch_table), step
        assert torch.equal(kernel_tokens, torch_tokens), step
        expected_ids = kernel_tokens[torch.from_numpy(rows).cuda(), torch.from_numpy(cached).cuda()]
        assert torch.equal(by_kernel.input_ids[:bs], expected_ids) and torch.equal(by_torch.input_ids[:bs], expected_ids), step
        if values is not None:
            assert torch.equal(expected_ids, values), step
        for name in ("out_loc", "table_rows", "cached_lens", "device_lens", "input_ids", "append_index"):
            assert torch.equal(getattr(by_kernel, name), getattr(by_torch, name)), (step, name)
        assert by_kernel.num_padded == (0 if pad_to is None else 3)
        lists, expected = by_kernel.page_lists, by_torch.page_lists
        assert lists.view_page_size == list_size
        assert torch.equal(lists.indptr, expected.indptr) and torch.equal(lists.last_page_len, expected.last_page_len)
        assert lists.indptr.is_pinned() and lists.indices.device.type == "cuda"
        assert torch.equal(lists.indices, expected.indices), step


def test_staging_ahead_of_a_busy_device_keeps_every_step_intact():
    """The host stages while the device is busy (a sleep kernel first): each step's fields, its
    page lists and its host arrays read by stream-ordered copies (as plan() does) hold that
    step's values once the device gets there - the ring waits for the device's step reports
    rather than rewriting host memory still to be read."""
    rng = np.random.default_rng(5)
    num_rows, width = 33, 512
    table = torch.randint(0, 1 << 20, (num_rows, width), dtype=torch.int32, device="cuda") * 16
    stager = DecodeStager(table, torch.zeros_like(table), page_size=16, page_list_size=16)
    captured, expected = [], []
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time: the host runs ahead
    for _ in range(12):
        bs = int(rng.integers(1, num_rows))
        rows = rng.permutation(num_rows - 1)[:bs].astype(np.int64)
        cached = rng.integers(0, width - 1, bs)
        batch = stager.stage(rows, cached)
        lists = batch.page_lists
        captured.append([batch.out_loc.clone(), lists.indices.clone(), batch.device_lens_cpu.to("cuda", non_blocking=True),
                         lists.indptr.to("cuda", non_blocking=True), lists.last_page_len.to("cuda", non_blocking=True)])
        reference = PagedIndexBuilder(table, 16, use_kernel=False).build(torch.from_numpy(rows).int().cuda(),
                                                                          torch.from_numpy(cached + 1).int())
        expected.append([table[torch.from_numpy(rows).cuda(), torch.from_numpy(cached).cuda()], reference.indices,
                         torch.from_numpy(cached + 1).int(), reference.indptr, reference.last_page_len])
    torch.cuda.synchronize()
    assert int(stager.progress.tensor[0]) == 12
    for step, (got, want) in enumerate(zip(captured, expected)):
        for name, a, b in zip(("out_loc", "indices", "device_lens", "indptr", "last_page_len"), got, want):
            assert torch.equal(a.cpu(), b.cpu()), (step, name)
