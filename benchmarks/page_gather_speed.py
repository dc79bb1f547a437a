"""How fast can the host tier gather K/V pages of the device pool into page-contiguous staging (and
scatter them back)? The pool is ``[2, L, pages + 1, P, H, D]``: one page of one layer is a
contiguous ``P * H * D`` block, a host page wants all ``2 * L`` of them contiguous.

    python benchmarks/page_gather_speed.py
"""

from __future__ import annotations

import time

import torch


def timed_ms(action, repeats: int = 10) -> float:
    action()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        action()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def widest(tensor: torch.Tensor) -> torch.Tensor:
    row_bytes = tensor.shape[-1] * tensor.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0:
            return tensor.view(dtype)
    return tensor


def main() -> None:
    layers, pages, page_size, heads, head_dim = 28, 4096, 16, 8, 128
    kv = torch.randn(2, layers, pages + 1, page_size, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    count = 584  # ~1 GiB of pages
    index = torch.randperm(pages, device="cuda")[:count]
    nbytes = count * 2 * layers * page_size * heads * head_dim * 2
    by_page = kv.permute(2, 0, 1, 3, 4, 5)
    wide = widest(kv)
    wide_by_page = wide.permute(2, 0, 1, 3, 4, 5)
    flat = wide.view(2 * layers, pages + 1, -1)  # [2L, pages + 1, page elements]
    expected = torch.index_select(by_page, 0, index)

    variants = {
        "index_select bf16, permuted view (today)": lambda: torch.index_select(by_page, 0, index),
        "index_select widest dtype, permuted view": lambda: torch.index_select(wide_by_page, 0, index),
        "advanced index widest dtype, permuted view": lambda: wide_by_page[index],
        "index_select dim 1 of [2L, pages, page] + transpose": lambda: flat.index_select(1, index).transpose(0, 1).contiguous(),
    }
    for name, action in variants.items():
        result = action()
        same = torch.equal(result.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))
        ms = timed_ms(action)
        print(f"gather  {name:55s} {ms:7.2f} ms  {nbytes / ms / 1e6:7.1f} GB/s  {'ok' if same else 'WRONG'}")

    staging = expected.clone()
    wide_staging = widest(staging)
    scatters = {
        "index_copy_ bf16, permuted view (today)": lambda: by_page.index_copy_(0, index, staging),
        "index_copy_ widest dtype, permuted view": lambda: wide_by_page.index_copy_(0, index, wide_staging),
        "advanced index_put widest dtype, permuted view": lambda: wide_by_page.__setitem__(index, wide_staging),
        "index_copy_ dim 1 of [2L, pages, page] from transposed": lambda: flat.index_copy_(
            1, index, wide_staging.view(count, 2 * layers, -1).transpose(0, 1)),
    }
    for name, action in scatters.items():
        kv.zero_()
        action()
        same = torch.equal(torch.index_select(by_page, 0, index), staging)
        ms = timed_ms(action)
        print(f"scatter {name:55s} {ms:7.2f} ms  {nbytes / ms / 1e6:7.1f} GB/s  {'ok' if same else 'WRONG'}")


if __name__ == "__main__":
    main()
