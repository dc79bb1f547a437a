"""SGLang decode CUDA graphs with kvplug attention, captured and replayed on the GPU.

``KvplugAttnBackend``'s graph hooks driven as SGLang 0.5.23's ``DecodeCudaGraphRunner`` drives
them, with SGLang's own runner inputs (``tests/sglang_graph_world.py``): ``init_cuda_graph_state``;
per captured size, largest first, ``init_forward_metadata_out_graph(capture batch,
in_capture=True)``, two warm-up forwards on a side stream and the forward captured in a real
``torch.cuda.CUDAGraph`` (one graph memory pool); per step, SGLang's padded replay view (SGLang's
registry fills it; the view object is ``replica_replay_view``'s, since SGLang's graph-runner
module does not import on the GPU machine, see ``sglang_graph_world.py``),
``init_forward_metadata_out_graph(view)`` and ``graph.replay()``. Every replay is compared with the
same kvplug attention backend run eagerly (``init_forward_metadata``) on the same pool contents:
outputs of the live requests equal, the pool bit-identical everywhere but the dummy location,
which the padded slots wrote. kvplug attention ``triton``, ``torch`` and ``flashinfer`` (when
importable), page sizes 1 and 16, live batch sizes between the captured ones.

Skipped without CUDA. On the GPU machine, ``scripts/device-sglang-graphs.sh`` runs this file with
SGLang installed from its wheel and the import placeholders of ``tests/sglang_gpu_support`` (no
sgl-kernel there, so SGLang's own CUDA attention backends are not run: the comparison is kvplug's
backends captured against themselves eagerly; ``tests/test_sglang_graphs.py`` compares the graph
path with the eager one on the CPU and ``tests/test_sglang_host.py`` the eager one with SGLang's
torch-native backend).
"""

from __future__ import annotations

import pytest
import torch

from tests.attention_reference import importable, requires_cuda
from tests.sglang_helpers import import_sglang

pytestmark = [pytest.mark.gpu, requires_cuda]


def _flashinfer_sglang_cannot_import() -> str | None:
    """Why SGLang's modules cannot import next to the installed FlashInfer, or ``None``.

    SGLang 0.5.23 pins ``flashinfer_python==0.7.2`` and, when FlashInfer is importable, imports
    names only that release has (``flashinfer.fused_moe.trtllm_mxint4_block_scale_moe``); the GPU
    machine's own FlashInfer wheels are 0.5.3 (0.7.2 travels chunked: scripts/device-sglang-graphs.sh
    PART). A mismatch is reported as a skip, not as a failure of kvplug."""
    from importlib import metadata

    try:
        installed = metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        return None
    pins = [req for req in (metadata.requires("sglang") or []) if req.replace("-", "_").startswith("flashinfer_python")]
    pinned = pins[0].split("==", 1)[1].split(";")[0].strip() if pins and "==" in pins[0] else None
    if pinned is None or pinned == installed:
        return None
    return (f"SGLang {metadata.version('sglang')} pins flashinfer {pinned} and imports names it has; flashinfer "
            f"{installed} is installed: run this file without FlashInfer (scripts/device-sglang-graphs.sh)")


if (_mismatch := _flashinfer_sglang_cannot_import()) is not None:
    pytest.skip(_mismatch, allow_module_level=True)

import_sglang()

from kvplug_sglang.attention_backend import KvplugAttnBackend  # noqa: E402
from tests.sglang_graph_world import HEAD_DIM, KV_HEADS, Q_HEADS, GraphWorld, RunnerInputs  # noqa: E402

CAPTURED = [1, 2, 4, 8]  # kvplug's default_batch_sizes(8), which the backend uses outside a server
STEPS = [[0, 2, 4], [1, 3, 5, 6, 0], [6, 5, 4, 3, 2, 1, 0], [2], [4, 6], [0, 1, 2, 3, 4, 5], [3, 1, 5, 6], [5, 0, 3]]
PREFIXES = [5, 17, 1, 30, 9, 16, 2]
BACKENDS = [
    "triton",
    "torch",
    pytest.param(
        "flashinfer",
        marks=pytest.mark.skipif(
            not importable("flashinfer"),
            reason="needs flashinfer, not installed (SGLang 0.5.23 needs its pinned flashinfer 0.7.2; on the GPU machine "
            "scripts/device-sglang-graphs.sh PART brings it in chunks, docs/device.md)",
        ),
    ),
]
# bf16 outputs of the same kernels over batches padded differently (split counts follow the batch size)
TOLERANCE = dict(rtol=2e-2, atol=2e-2)


def random_inputs(world: GraphWorld, n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [
        (world.random(n, Q_HEADS * HEAD_DIM), world.random(n, KV_HEADS, HEAD_DIM), world.random(n, KV_HEADS, HEAD_DIM))
        for _ in world.layers
    ]


def assert_same_kv_but_dummy(world: GraphWorld, got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    keep = torch.ones(got[0].shape[0], dtype=torch.bool, device=got[0].device)
    keep[list(world.dummy_locations)] = False
    for layer_got, layer_expected in zip(got, expected):
        assert torch.equal(layer_got[keep], layer_expected[keep])


class CapturedDecode:
    """One CUDA graph per captured size over fixed per-layer q/k/v inputs, as SGLang captures."""

    def __init__(self, backend: KvplugAttnBackend, world: GraphWorld, inputs: RunnerInputs) -> None:
        self.backend, self.world = backend, world
        max_bs = CAPTURED[-1]
        self.static = [
            (torch.zeros(max_bs, Q_HEADS * HEAD_DIM, dtype=world.dtype, device="cuda"),
             torch.zeros(max_bs, KV_HEADS, HEAD_DIM, dtype=world.dtype, device="cuda"),
             torch.zeros(max_bs, KV_HEADS, HEAD_DIM, dtype=world.dtype, device="cuda"))
            for _ in world.layers
        ]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]] = {}
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for bs in reversed(CAPTURED):
            capture = inputs.capture_batch(bs)
            backend.init_forward_metadata_out_graph(capture, in_capture=True)

            def forward(bs=bs, capture=capture) -> list[torch.Tensor]:
                backend.init_forward_metadata_in_graph(capture)
                return [
                    backend.forward(q[:bs], k[:bs], v[:bs], layer, capture)
                    for layer, (q, k, v) in zip(world.layers, self.static)
                ]

            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # SGLang's two warm-up forwards
                    forward()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = forward()
            self.graphs[bs] = (graph, outputs)

    def replay(self, view, padded_inputs) -> list[torch.Tensor]:
        bs = view.batch_size
        for static, given in zip(self.static, padded_inputs):
            for buffer, values in zip(static, given):
                buffer[:bs].copy_(values)
        self.backend.init_forward_metadata_out_graph(view)
        graph, outputs = self.graphs[bs]
        graph.replay()
        return [out.clone() for out in outputs]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("attention", BACKENDS)
def test_captured_decode_replays_equal_eager_and_keep_live_kv(attention, page_size):
    world = GraphWorld("cuda", page_size, torch.bfloat16, PREFIXES, seed=page_size)
    graphs, eager = KvplugAttnBackend(world.runner, attention), KvplugAttnBackend(world.runner, attention)
    max_bs = CAPTURED[-1]
    graphs.init_cuda_graph_state(max_bs, max_bs)
    inputs = RunnerInputs("cuda", max_bs, graphs.get_cuda_graph_seq_len_fill_value())

    before_capture = world.kv_snapshot()
    captured = CapturedDecode(graphs, world, inputs)
    torch.cuda.synchronize()
    assert_same_kv_but_dummy(world, world.kv_snapshot(), before_capture)  # capture wrote the dummy slot only

    padded_steps = 0
    for requests in STEPS:
        step = world.decode_batch(requests)
        raw_bs = len(requests)
        bs = next(size for size in CAPTURED if size >= raw_bs)
        padded_steps += bs > raw_bs
        live_inputs = random_inputs(world, raw_bs)
        before = world.kv_snapshot()

        eager.init_forward_metadata(step)
        expected = [eager.forward(q, k, v, layer, step) for layer, (q, k, v) in zip(world.layers, live_inputs)]
        expected_kv = world.kv_snapshot()
        world.restore(before)

        padding = random_inputs(world, bs - raw_bs)
        padded_inputs = [tuple(torch.cat([a, b]) for a, b in zip(live, pad)) for live, pad in zip(live_inputs, padding)]
        view = inputs.replay_view(step, bs, sglang_builder=False)  # SGLang's graph-runner module: no import here
        for _ in range(2):  # a repeated padded replay changes nothing either
            outputs = captured.replay(view, padded_inputs)
            torch.cuda.synchronize()
            for out, reference in zip(outputs, expected):
                torch.testing.assert_close(out[:raw_bs], reference, **TOLERANCE)
                assert out[raw_bs:].isfinite().all()
            assert_same_kv_but_dummy(world, world.kv_snapshot(), expected_kv)  # live KV bit-identical
            if bs > raw_bs:  # the dummy location holds a padded slot's K (which one: the GPU's write order)
                assert any(torch.equal(world.kv.k_buffer[-1][0], k) for k in padded_inputs[-1][1][raw_bs:])
    assert padded_steps >= 4
