"""kvplug's Triton kernels run by Triton's interpreter on the CPU, against their torch reference
paths: the decode-step kernel (batch fields, new pages, pending tokens, page lists, step reports,
padding), the page-list
writer, the store_kv kernel, and the decode (one and several KV splits) and extend attention
kernels against the dense SDPA oracle. Run as ``TRITON_INTERPRET=1 python -m tests.kernels_interpreted`` (the
flag must be set before Triton is imported, so ``test_kernels_interpreted`` runs this in a
subprocess). The interpreter runs programs one after another, so ordering between programs is
not exercised here; the GPU tests cover the same checks on the device.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from kvplug.attention.decode_staging import DecodeStager
from kvplug.attention.paged_indices import PagedIndexBuilder
from kvplug.memory.allocator import NewPages

STEPS = [(1, 20), (7, 20), (24, 300), (7, 300), (24, 300)]  # (batch, longest)


def check_decode_step(page_size: int, list_size: int | None, with_pages: bool) -> None:
    """The kernel and the torch path stage the same fields, table and token pool: new pages,
    pending tokens, page lists, step reports, ring reuse, and padding to a graph's batch size."""
    rng = np.random.default_rng(page_size * 100 + (list_size or 0) * 2 + with_pages)
    num_rows, width = 41, 300
    kernel_table = torch.from_numpy(rng.integers(0, 1 << 20, (num_rows, width)).astype(np.int32) * page_size)
    torch_table = kernel_table.clone()
    kernel_tokens = torch.from_numpy(rng.integers(0, 1 << 17, (num_rows, width)).astype(np.int32))
    torch_tokens = kernel_tokens.clone()
    storage = torch.from_numpy(rng.permutation(2048).astype(np.int32) * page_size)
    stagers = [
        DecodeStager(table, tokens, page_size=page_size, page_list_size=list_size, use_kernel=use_kernel)
        for table, tokens, use_kernel in ((kernel_table, kernel_tokens, True), (torch_table, torch_tokens, False))
    ]
    dummy_row = num_rows - 1
    for step, (bs, longest) in enumerate(STEPS, start=1):
        rows = rng.permutation(num_rows - 1)[:bs].astype(np.int64)
        cached = rng.integers(0, max(1, longest // page_size), bs) * page_size
        pages = None
        if with_pages:
            page_slot = np.where(rng.random(bs) < 0.6, rng.permutation(2048)[:bs], -1).astype(np.int32)
            pages = NewPages(np.where(page_slot >= 0, storage.numpy()[page_slot], -1).astype(np.int32))
        else:
            cached = np.minimum(cached + rng.integers(0, page_size, bs), width - 1)
        values = None if step % 2 else torch.from_numpy(rng.integers(0, 1 << 17, bs).astype(np.int32))
        pad_to = bs + int(rng.integers(1, 5)) if step % 3 == 0 else None
        by_kernel, by_torch = (stager.stage(rows, cached, pages=pages, tokens=values, pad_to=pad_to) for stager in stagers)
        where = (page_size, list_size, with_pages, step)
        assert torch.equal(kernel_table, torch_table), where
        assert torch.equal(kernel_tokens, torch_tokens), where
        n = bs if pad_to is None else pad_to
        all_rows = np.concatenate([rows, np.full(n - bs, dummy_row)])
        all_cached = np.concatenate([cached, np.zeros(n - bs, dtype=np.int64)])
        expected_ids = kernel_tokens[torch.from_numpy(all_rows), torch.from_numpy(all_cached)]
        assert torch.equal(by_kernel.input_ids, expected_ids) and torch.equal(by_torch.input_ids, expected_ids), where
        if values is not None:
            assert torch.equal(expected_ids[:bs], values), where
        assert by_kernel.num_padded == by_torch.num_padded == n - bs, where
        assert by_kernel.table_rows.tolist() == all_rows.tolist(), where
        for name in ("out_loc", "table_rows", "cached_lens", "device_lens", "append_index"):
            assert torch.equal(getattr(by_kernel, name), getattr(by_torch, name)), (where, name)
        assert by_kernel.append_index.tolist() == (all_rows * width + all_cached + 1).tolist(), where
        assert int(stagers[0].progress.tensor[0]) == step, where
        if list_size is not None:
            got, want = by_kernel.page_lists, by_torch.page_lists
            assert torch.equal(got.indptr, want.indptr) and torch.equal(got.last_page_len, want.last_page_len), where
            assert torch.equal(got.indices, want.indices), where


def check_page_list_writer() -> None:
    rng = np.random.default_rng(3)
    table = torch.from_numpy(rng.integers(0, 1 << 20, (9, 256)).astype(np.int32))
    for size in (1, 16):
        builders = [PagedIndexBuilder(table, size, use_kernel=use_kernel) for use_kernel in (True, False)]
        for bs in (0, 1, 5, 8, 3):
            rows = torch.from_numpy(rng.permutation(8)[:bs].astype(np.int32))
            lens = torch.from_numpy(rng.integers(1, 257, bs).astype(np.int32))
            got, want = builders[0].build(rows, lens, lens.clone()), builders[1].build(rows, lens)
            for name in ("indptr", "last_page_len", "indices"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (size, bs, name)


def check_store_kv() -> None:
    from kvplug.kernels.store_kv import store_kv_triton

    generator = torch.Generator().manual_seed(0)
    for n in (1, 7, 130):
        k_cache, v_cache = torch.zeros(2, 400, 2, 32, dtype=torch.float16).unbind(0)
        locations = torch.randperm(400, generator=generator)[:n].to(torch.int32)
        k = torch.randn(n, 2, 32, generator=generator).half()
        v = torch.randn(n, 64, generator=generator).half()
        store_kv_triton(k_cache, v_cache, locations, k, v)
        expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        expected_k[locations.long()], expected_v[locations.long()] = k, v.view(n, 2, 32)
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v), n


def check_attention_kernels() -> None:
    """Decode (one and several KV splits) and extend kernels against the dense SDPA oracle, over
    the random non-contiguous pools of the attention tests (K/V already stored)."""
    from kvplug.attention.triton_kernels.decode import decode_attention
    from kvplug.attention.triton_kernels.extend import extend_attention
    from tests.attention_reference import SCENARIOS, case_reference, make_case, relative_error

    for scenario, page_size, group in (("decode", 16, 2), ("decode", 1, 4), ("extend_with_prefix", 16, 2)):
        case = make_case(SCENARIOS[scenario], page_size=page_size, num_qo_heads=2 * group, num_kv_heads=2,
                         head_dim=32, dtype=torch.float16, seed=7 + page_size + group)
        case.pool.store_kv(case.k, case.v, case.batch.out_loc, case.layer_id)
        k_flat, v_flat = (cache.reshape(-1, 2, 32) for cache in (case.pool.k_cache(case.layer_id), case.pool.v_cache(case.layer_id)))
        batch, scale = case.batch, 32 ** -0.5
        for num_splits in ((1, 3) if batch.is_decode else (None,)):
            out = torch.empty_like(case.q)
            if batch.is_decode:
                rows = batch.batch_size * case.q.shape[1] * num_splits
                decode_attention(case.q, k_flat, v_flat, case.page_table, batch.table_rows, batch.device_lens, out,
                                 torch.empty(rows * 32), torch.empty(rows), num_splits, scale, block_n=64, num_warps=4)
            else:
                extend_lens = batch.extend_start_cpu[1:] - batch.extend_start_cpu[:-1]
                extend_attention(case.q, k_flat, v_flat, out, case.page_table, batch.table_rows, batch.cached_lens,
                                 batch.device_lens, batch.extend_start, int(extend_lens.max()), scale,
                                 block_m=32, block_n=32)
            error = relative_error(out, case_reference(case))
            assert error < 2e-3, (scenario, page_size, group, num_splits, error)


def index_one_element_scalars() -> None:
    """Triton 3.6's interpreter turns a scalar (a one-element array there) into an index with
    ``int(array)``, which NumPy >= 2.4 refuses for arrays with a dimension: loop bounds read from
    memory then fail (triton-lang/triton#9171, fixed after 3.6). Take the element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "kvplug_shim", False):
        return

    def patch(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch.kvplug_shim = True
    interpreter._patch_lang_tensor = patch


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (before Triton is imported) to run these checks")
    import triton

    if triton.__version__.startswith("3.6."):
        index_one_element_scalars()
    for page_size, list_size in ((1, None), (1, 1), (16, 1), (16, 16), (5, 5)):
        for with_pages in (False, True):
            check_decode_step(page_size, list_size, with_pages)
    check_page_list_writer()
    check_store_kv()
    check_attention_kernels()
    print("interpreted kernels: all checks passed")


if __name__ == "__main__":
    main()
