"""The GPU decode stager (one upload, one Triton launch) equals the general batch build field for
field, with the flat indices input_ids and append_tokens use, over random batches and through
the ring's slot reuse. Skipped without CUDA/Triton."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplug.attention.batch import build_attention_batch
from kvplug.attention.decode_staging import DecodeStager
from kvplug.interface import ForwardPhase
from tests.attention_reference import importable, requires_cuda
from tests.test_attention_batch import assert_same_batch

pytestmark = [
    pytest.mark.gpu,
    requires_cuda,
    pytest.mark.skipif(not importable("triton"), reason="needs triton (pip install kvplug[triton])"),
]


@pytest.mark.parametrize("use_kernel", [True, False])
def test_stager_equals_the_general_build(use_kernel):
    rng = np.random.default_rng(int(use_kernel))
    num_rows, width = 301, 4096
    table = torch.randint(0, 1 << 28, (num_rows, width), dtype=torch.int32, device="cuda")
    stager = DecodeStager(table, use_kernel=use_kernel)
    for bs in (1, 2, 255, 256, 257, 300, 7, 1):  # new sizes and repeats, so slots come round
        rows = rng.permutation(num_rows - 1)[:bs].astype(np.int64)
        cached = rng.integers(0, width - 1, bs)
        upload = stager.stage(rows, cached)
        general = build_attention_batch(table, rows, cached, cached + 1, ForwardPhase.PREFILL)
        assert_same_batch(upload.batch, general)
        cells = torch.from_numpy(rows * width + cached).cuda()
        assert upload.token_index.dtype == torch.int32 and torch.equal(upload.token_index.long(), cells)
        assert upload.append_index.dtype == torch.int64 and torch.equal(upload.append_index, cells + 1)
        assert np.array_equal(upload.device_lens_host, cached + 1)


def test_a_one_slot_ring_reuses_its_views_with_each_steps_values():
    """With one slot every step reuses the same views, and each step's copy and kernel (ordered
    on the stream) leave that step's values in them."""
    table = torch.arange(9 * 64, dtype=torch.int32, device="cuda").view(9, 64)
    stager = DecodeStager(table, ring_size=1)
    rows, cached = np.array([3, 1], dtype=np.int64), np.array([5, 9], dtype=np.int64)
    first = stager.stage(rows, cached)
    assert first.batch.out_loc.tolist() == [3 * 64 + 5, 64 + 9]
    second = stager.stage(rows, cached + 1)
    assert second.batch.out_loc is first.batch.out_loc  # one slot: the same views
    assert second.batch.out_loc.tolist() == [3 * 64 + 6, 64 + 10]
