"""kvplug's Triton and FlashInfer kernels reading vLLM-layout KV views, eagerly and inside a
``torch.cuda.CUDAGraph``, against kvplug's torch reference backend over the same views.

vLLM cannot be installed on the GPU machine (its wheels pin another torch), so this file does not
import it: ``vllm_layout_views`` rebuilds what vLLM 0.32's ``allocate_kv_cache`` hands the
``KVPLUG`` backend for the ``LBNHC`` layout (one int8 buffer; per layer a logical
``[B, H, N, 2 * D]`` strided view, physically ``[B, N, H, 2 * D]``), and ``LayoutPool`` is the same
view arithmetic as ``kvplug_vllm.attention_backend.VllmKVViews`` (``tests/test_vllm_attention.py``
checks the two agree where vLLM is installed). Batches follow vLLM's padding the way the adapter
maps it: padding requests are kvplug dummy requests on the table's last row, which points at the
null block 0. Skipped without CUDA (the ``gpu`` marker).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvplug.attention import build_attention_batch
from kvplug.interface import AttentionConfig, BaseKVPool, ForwardPhase
from kvplug.plugins import default_manager
from tests.attention_reference import importable, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_LAYERS, NUM_BLOCKS, BLOCKS_PER_ROW = 3, 160, 16  # blocks: 8 rows x 16, null block 0, spare
Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
MAX_REQS = 8
BOUND = 1.5e-2  # bf16, as tests/test_attention_gpu.py

requires_triton = pytest.mark.skipif(not importable("triton"), reason="needs triton (pip install -e '.[triton]')")
requires_flashinfer = pytest.mark.skipif(
    not importable("flashinfer"), reason="needs flashinfer (pip install -e '.[flashinfer]')"
)


def vllm_layout_views(
    num_layers: int, num_blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype, device
) -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, 2D]`` views of one int8 buffer, as vLLM's ``create_kv_cache_views``
    makes them for ``LBNHC`` (byte strides: C 1, H C, N H*C, B N*H*C, L B*N*H*C)."""
    content = 2 * dim * torch.empty(0, dtype=dtype).element_size()
    page = block_size * heads * content
    raw = torch.zeros(num_layers * num_blocks * page, dtype=torch.int8, device=device)
    view_5d = torch.as_strided(
        raw, (num_layers, num_blocks, heads, block_size, content), (num_blocks * page, page, content, heads * content, 1)
    )
    return [view_5d[layer].view(dtype) for layer in range(num_layers)]


class LayoutPool(BaseKVPool):
    """A kvplug pool over vLLM-layout views: K is ``kv.transpose(1, 2)[..., :D]``, V the rest;
    page ``b`` is vLLM block ``b``; the dummy location is the null block's slot 0."""

    def __init__(self, views: list[torch.Tensor], dim: int) -> None:
        self.views = views
        self._k = [kv.transpose(1, 2)[..., :dim] for kv in views]
        self._v = [kv.transpose(1, 2)[..., dim:] for kv in views]
        blocks, heads, block_size, _ = views[0].shape
        self._shape = (blocks, block_size, heads, dim)

    def k_cache(self, layer_id):
        return self._k[layer_id]

    def v_cache(self, layer_id):
        return self._v[layer_id]

    def store_kv(self, k, v, out_loc, layer_id):
        blocks, block_size, heads, dim = self._shape
        flat = (blocks * block_size, heads, dim)
        self._k[layer_id].view(flat)[out_loc] = k.reshape(-1, heads, dim)
        self._v[layer_id].view(flat)[out_loc] = v.reshape(-1, heads, dim)

    num_layers = property(lambda self: len(self.views))
    num_pages = property(lambda self: self._shape[0] - 1)
    page_size = property(lambda self: self._shape[1])
    local_kv_heads = property(lambda self: self._shape[2])
    head_dim = property(lambda self: self._shape[3])
    dtype = property(lambda self: self.views[0].dtype)
    device = property(lambda self: self.views[0].device)
    dummy_location = property(lambda self: 0)


class World:
    """Views filled with random K/V, a block table of shuffled blocks (block 0 never handed out)
    and kvplug's token table over it, the dummy row last and all null-block slot 0."""

    def __init__(self, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.rng = np.random.default_rng(seed)
        torch.manual_seed(seed)
        self.views = vllm_layout_views(NUM_LAYERS, NUM_BLOCKS, block_size, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
        for view in self.views:
            view.copy_(torch.randn(view.shape, device="cuda").to(torch.bfloat16))
        self.pool = LayoutPool(self.views, HEAD_DIM)
        self.table = torch.zeros(MAX_REQS + 1, BLOCKS_PER_ROW * block_size, dtype=torch.int32, device="cuda")
        blocks = self.rng.permutation(np.arange(1, NUM_BLOCKS))[: MAX_REQS * BLOCKS_PER_ROW]
        block_table = torch.from_numpy(blocks.reshape(MAX_REQS, BLOCKS_PER_ROW).astype(np.int32)).cuda()
        offsets = torch.arange(block_size, dtype=torch.int32, device="cuda")
        slots = block_table.unsqueeze(2) * block_size + offsets
        self.table[:MAX_REQS] = slots.reshape(MAX_REQS, -1)

    def backend(self, name: str, **options):
        config = AttentionConfig(pool=self.pool, page_table=self.table, num_qo_heads=Q_HEADS, num_kv_heads=KV_HEADS,
                                 head_dim=HEAD_DIM, options=options)
        return default_manager().create_attention_backend(name, config)

    def batch(self, lens: list[tuple[int, int]], num_padded: int = 0):
        """Requests ``(cached_len, new_tokens)`` on rows ``0..``, then ``num_padded`` dummy requests."""
        rows = list(range(len(lens))) + [MAX_REQS] * num_padded
        cached = [c for c, _ in lens] + [0] * num_padded
        device = [c + n for c, n in lens] + [1] * num_padded
        phase = ForwardPhase.DECODE if all(n == 1 for _, n in lens) else ForwardPhase.PREFILL
        return build_attention_batch(self.table, rows, cached, device, phase, num_padded=num_padded)

    def qkv(self, num_tokens: int):
        shape = lambda heads: (num_tokens, heads, HEAD_DIM)  # noqa: E731
        return tuple(torch.randn(shape(h), device="cuda").to(torch.bfloat16) for h in (Q_HEADS, KV_HEADS, KV_HEADS))


def run(backend, batch, q, k, v, layer: int = 1) -> torch.Tensor:
    planned = dataclasses.replace(batch, metadata=None)
    backend.prepare_metadata(planned)
    return backend.forward(q, k, v, layer, planned)


def live_tokens(batch) -> int:
    return int(batch.extend_start_cpu[batch.batch_size - batch.num_padded])


KERNELS = [
    pytest.param("triton", {}, marks=requires_triton, id="triton"),
    pytest.param("flashinfer", {"kv_view": "page"}, marks=requires_flashinfer, id="flashinfer-page"),
    pytest.param("flashinfer", {"kv_view": "token"}, marks=requires_flashinfer, id="flashinfer-token"),
]
STEPS = {
    "prefill": ([(0, 70), (0, 9)], 0),
    "extend-after-prefix": ([(48, 33), (17, 1), (100, 12)], 0),
    "decode": ([(80, 1), (15, 1), (16, 1), (200, 1)], 0),
    "decode-padded": ([(64, 1), (3, 1), (130, 1)], 2),
}


def test_the_views_are_strided_like_vllms():
    views = vllm_layout_views(2, 5, 16, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    assert views[0].shape == (5, KV_HEADS, 16, 2 * HEAD_DIM)
    assert views[0].stride() == (16 * KV_HEADS * 2 * HEAD_DIM, 2 * HEAD_DIM, KV_HEADS * 2 * HEAD_DIM, 1)
    assert not LayoutPool(views, HEAD_DIM).k_cache(0).is_contiguous()


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("kernel, options", KERNELS)
def test_eager_kernels_match_the_torch_reference(kernel, options, step, block_size):
    lens, num_padded = STEPS[step]
    world = World(block_size, seed=block_size + len(step))
    batch = world.batch(lens, num_padded)
    q, k, v = world.qkv(batch.num_tokens)
    reference = run(world.backend("torch"), batch, q, k, v)
    stored = [view.clone() for view in world.views]
    out = run(world.backend(kernel, **options), batch, q, k, v)
    torch.cuda.synchronize()
    n = live_tokens(batch)
    error = relative_error(out[:n].view(n, Q_HEADS, HEAD_DIM), reference[:n].view(n, Q_HEADS, HEAD_DIM).cpu().double())
    assert error < BOUND, f"{kernel} over vLLM-layout views: relative error {error:.2e}"
    assert torch.isfinite(out).all()
    for before, after in zip(stored, world.views):  # the kernel stored the same K/V at the same slots
        assert torch.equal(before, after)


@pytest.mark.parametrize("kernel, options", KERNELS)
def test_decode_in_a_cuda_graph_matches_the_torch_reference(kernel, options):
    """Capture one padded decode step of 4 requests over fixed batch tensors, then replay steps
    with other lengths and rows written into them (what the adapter's builder does per step)."""
    world = World(16, seed=11)
    backend = world.backend(kernel, **options)
    backend.init_capture_graph(world.table.shape[1], [4])
    capture = world.batch([(1, 1), (1, 1), (1, 1)], num_padded=1)
    static = dataclasses.replace(capture, metadata=None)  # its device tensors are the graph's inputs
    q, k, v = world.qkv(4)
    backend.prepare_for_capture(static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.forward(q, k, v, 0, static)  # warm-up (Triton compiles, FlashInfer loads)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, 0, static)
    reference_backend = world.backend("torch")
    for step, lens in enumerate([[(40, 1), (7, 1), (129, 1)], [(200, 1), (16, 1), (31, 1)]]):
        fresh = world.batch(lens, num_padded=1)
        for field in ("table_rows", "cached_lens", "device_lens", "extend_start", "positions", "out_loc"):
            getattr(static, field).copy_(getattr(fresh, field))
        replay = dataclasses.replace(static, cached_lens_cpu=fresh.cached_lens_cpu,
                                     device_lens_cpu=fresh.device_lens_cpu, extend_start_cpu=fresh.extend_start_cpu)
        backend.prepare_for_replay(replay)
        nq, nk, nv = world.qkv(4)
        q.copy_(nq), k.copy_(nk), v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        reference = run(reference_backend, fresh, nq, nk, nv, layer=0)
        error = relative_error(out[:3].view(3, Q_HEADS, HEAD_DIM), reference[:3].view(3, Q_HEADS, HEAD_DIM).cpu().double())
        assert error < BOUND, f"{kernel} replay {step}: relative error {error:.2e}"
        assert torch.isfinite(out).all()
