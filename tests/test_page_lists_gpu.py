"""The Triton page-list kernel equals the torch-op builder (and per-request slicing), value for
value, over random batches: page views 1/16/64, batch sizes 1..300, lengths up to 40k tokens (so
one request's pages span many programs), rows in random order. Skipped without CUDA/Triton."""

from __future__ import annotations

import pytest
import torch

from kvplug.attention.paged_indices import PagedIndexBuilder
from tests.attention_reference import importable, requires_cuda

pytestmark = [
    pytest.mark.gpu,
    requires_cuda,
    pytest.mark.skipif(not importable("triton"), reason="needs triton (pip install -e \".[triton]\")"),
]


@pytest.mark.parametrize("view_page_size", [1, 16, 64])
@pytest.mark.parametrize("batch_size, max_len", [(1, 1), (1, 40_000), (7, 3000), (64, 2048), (300, 700)])
def test_kernel_equals_torch_builder(view_page_size, batch_size, max_len):
    gen = torch.Generator().manual_seed(batch_size * 1000 + view_page_size)
    num_rows, width = max(batch_size, 8) + 1, 40_064
    table = torch.randint(0, 1 << 28, (num_rows, width), generator=gen, dtype=torch.int32).cuda()
    rows = torch.randperm(num_rows - 1, generator=gen)[:batch_size].to(torch.int32)
    lens = torch.randint(1, max_len + 1, (batch_size,), generator=gen, dtype=torch.int32)
    lens[0] = max_len
    kernel = PagedIndexBuilder(table, view_page_size, use_kernel=True)
    reference = PagedIndexBuilder(table, view_page_size, use_kernel=False)
    built = kernel.build(rows.cuda(), lens, lens.cuda())
    expected = reference.build(rows.cuda(), lens)
    assert torch.equal(built.indptr, expected.indptr)
    assert torch.equal(built.last_page_len, expected.last_page_len)
    assert built.indices.dtype == torch.int32 and built.indices.device.type == "cuda"
    assert torch.equal(built.indices, expected.indices)
    # and both equal slicing each request's row
    first = int(built.indptr[1])
    assert torch.equal(built.indices[:first], table[int(rows[0]), : first * view_page_size : view_page_size] // view_page_size)
    # device_lens may be omitted (uploaded from the host values)
    assert torch.equal(kernel.build(rows.cuda(), lens).indices, expected.indices)


def test_kernel_handles_an_empty_batch():
    table = torch.zeros(4, 64, dtype=torch.int32, device="cuda")
    empty = torch.zeros(0, dtype=torch.int32)
    built = PagedIndexBuilder(table, 16, use_kernel=True).build(empty.cuda(), empty, empty.cuda())
    assert built.indices.numel() == 0 and built.indptr.tolist() == [0]


def test_results_live_for_the_ring_and_bound_launches_follow_new_values():
    """The same rows/lengths tensors (a stager slot's) with new values each build: every build is
    right (the bound launch reads the tensors' current values), and a result stays intact until
    the ring comes round."""
    table = torch.randint(0, 1 << 20, (9, 256), dtype=torch.int32, device="cuda")
    builder = PagedIndexBuilder(table, 16, use_kernel=True)
    reference = PagedIndexBuilder(table, 16, use_kernel=False)
    rows, lens = torch.zeros(3, dtype=torch.int32, device="cuda"), torch.zeros(3, dtype=torch.int32, device="cuda")
    results = []
    for step in range(5):
        rows.copy_(torch.tensor([step, 7 - step, 8], dtype=torch.int32))
        lens.copy_(torch.tensor([1 + 30 * step, 200 - step, 16], dtype=torch.int32))
        built = builder.build(rows, lens.cpu(), lens)
        expected = reference.build(rows, lens.cpu())
        assert torch.equal(built.indices, expected.indices), step
        results.append((built.indices, expected.indices.clone()))
        for indices, snapshot in results[-3:]:
            assert torch.equal(indices, snapshot)
