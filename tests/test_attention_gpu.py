"""GPU backends (triton, flashinfer; fa3 where sgl-kernel exists) against the dense SDPA oracle,
in bf16 and fp16, over random non-contiguous pools. Skipped without CUDA.

FlashInfer compiles each module on first use (tens of seconds each), so its sweep over page sizes,
GQA ratios and scenarios runs at bf16 / head_dim 128, and the other dtype / head-dim combinations
run a smaller set. The module fixture builds all of them in one ninja run (``warm_up_flashinfer``);
run it in a separate process before pytest to pay the compile outside pytest's timeouts.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import kvplug
from tests.attention_reference import (
    LONG_SCENARIOS,
    SCENARIOS,
    case_reference,
    chunk_lens,
    importable,
    make_case,
    relative_error,
    requires_cuda,
    run_case,
)
from kvplug.attention import build_attention_batch
from kvplug.interface import ForwardPhase

pytestmark = [pytest.mark.gpu, requires_cuda]

ALL_SCENARIOS = {**SCENARIOS, **LONG_SCENARIOS}
BOUND = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


requires_triton = pytest.mark.skipif(not importable("triton"), reason="needs triton (pip install -e '.[triton]')")
requires_flashinfer = pytest.mark.skipif(
    not importable("flashinfer"), reason="needs flashinfer (pip install -e '.[flashinfer]')"
)


def check_backend(name, case, bound, **options):
    expected_pool = case.expected_pool()
    out = run_case(name, case, **options)
    torch.cuda.synchronize()
    error = relative_error(out, case_reference(case))
    assert error < bound, f"relative error {error:.2e} >= {bound:.0e}"
    assert torch.equal(case.pool.kv_buffer, expected_pool), "the pool differs outside this step's out_loc"


# ------------------------------------------------------------------------------------ triton
@requires_triton
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("scenario", sorted(ALL_SCENARIOS))
def test_triton_matches_dense_reference(scenario, page_size, group, head_dim, dtype):
    case = make_case(
        ALL_SCENARIOS[scenario], page_size=page_size, num_qo_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
        dtype=DTYPES[dtype], device="cuda", seed=page_size * 1000 + group * 100 + head_dim + len(scenario),
    )
    check_backend("triton", case, BOUND[DTYPES[dtype]])


@requires_triton
@pytest.mark.parametrize("num_splits_cap", [1, 64])
def test_triton_split_counts_agree(num_splits_cap):
    case = make_case(LONG_SCENARIOS["long_decode"], page_size=16, num_qo_heads=16, num_kv_heads=8, head_dim=128,
                     dtype=torch.bfloat16, device="cuda", seed=3)
    check_backend("triton", case, BOUND[torch.bfloat16], max_splits=num_splits_cap)


# ------------------------------------------------------------------------------------ flashinfer
FLASHINFER_BF16_128 = [(torch.bfloat16, 128, group) for group in (1, 2, 4, 8)]
FLASHINFER_OTHER = [(torch.float16, 128, 2), (torch.bfloat16, 64, 2)]
# One variant per FlashInfer JIT module the tests (and the attention/graphs/e2e benchmarks, all
# bf16 / 128) need: CUDA-core decode (group < 4), tensor-core decode (group >= 4: FlashInfer's fa2
# prefill module) and prefill (fa3 on Hopper), per dtype and head dim.
FLASHINFER_MODULES = [
    (torch.bfloat16, 128, 2, "decode"),
    (torch.bfloat16, 128, 4, "decode"),
    (torch.bfloat16, 128, 2, "extend_with_prefix"),
    (torch.float16, 128, 2, "decode"),
    (torch.float16, 128, 2, "extend_with_prefix"),
    (torch.bfloat16, 64, 2, "decode"),
    (torch.bfloat16, 64, 2, "extend_with_prefix"),
]


class FlashInferWarmUp(NamedTuple):
    """seconds: wall time; modules: the JIT module names built (or found up to date) in one
    ninja run; compiled_late: modules the backend still had to compile afterwards (should be empty)."""

    seconds: float
    modules: tuple[str, ...]
    compiled_late: tuple[str, ...]


class _ModuleRequested(Exception):
    """Raised by the dry run instead of compiling: it only records what ``plan()`` asks for."""


def _plan_variant(variant) -> None:
    dtype, dim, group, phase = variant
    case = make_case(SCENARIOS[phase][:2], page_size=16, num_qo_heads=2 * group, num_kv_heads=2,
                     head_dim=dim, dtype=dtype, device="cuda")
    run_case("flashinfer", case)
    torch.cuda.synchronize()


@contextlib.contextmanager
def _intercepted_build_and_load(hook):
    from flashinfer.jit import JitSpec

    original = JitSpec.build_and_load
    JitSpec.build_and_load = lambda spec: hook(spec, original)
    try:
        yield
    finally:
        JitSpec.build_and_load = original


def warm_up_flashinfer(variants=FLASHINFER_MODULES) -> FlashInferWarmUp:
    """Compile every FlashInfer module ``variants`` need in ONE ninja process, then load them.

    Why one ninja: FlashInfer runs each module's ninja with ``-C`` its shared ``cached_ops`` dir,
    so concurrent builds (threads, or a second process) write the same ``.ninja_deps``; ninja
    assigns node ids per process, the next ninja finds the id mismatch, truncates the log and
    rebuilds every object whose deps went missing -- the warm cache is thrown away. So: a dry run
    plans each variant through kvplug's backend with ``JitSpec.build_and_load`` recording the
    spec (FlashInfer's own fa2/fa3 and tensor-core choices, nothing restated here), then
    ``flashinfer.jit.build_jit_specs`` builds them all (parallel inside ninja; a no-op in about
    a second when the cache is warm), then a real run loads them. Never run two at once."""
    import flashinfer.jit

    start = time.perf_counter()
    requested: dict[str, Any] = {}

    def record(spec, original):
        requested[spec.name] = spec
        raise _ModuleRequested(spec.name)

    with _intercepted_build_and_load(record):
        for variant in variants:
            with contextlib.suppress(_ModuleRequested):
                _plan_variant(variant)
    flashinfer.jit.build_jit_specs(list(requested.values()), verbose=False)
    late: list[str] = []

    def load(spec, original):
        if not spec.is_compiled:
            late.append(spec.name)
        return original(spec)

    with _intercepted_build_and_load(load):
        for variant in variants:
            _plan_variant(variant)
    return FlashInferWarmUp(time.perf_counter() - start, tuple(requested), tuple(late))


@pytest.fixture(scope="module")
def flashinfer_compiled():
    log_warm_up(warm_up_flashinfer())


def log_warm_up(warm_up: FlashInferWarmUp) -> None:
    logger = logging.getLogger(__name__)
    logger.warning("FlashInfer JIT warm-up took %.1f s for %d modules", warm_up.seconds, len(warm_up.modules))
    if warm_up.compiled_late:  # slow, not wrong: the tests still run
        logger.warning("FlashInfer modules compiled outside the batched build: %s", warm_up.compiled_late)


@requires_flashinfer
@pytest.mark.parametrize("kv_view", ["token", "page"])
@pytest.mark.parametrize("dtype, head_dim, group", FLASHINFER_BF16_128)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("scenario", sorted(ALL_SCENARIOS))
def test_flashinfer_matches_dense_reference(flashinfer_compiled, scenario, page_size, dtype, head_dim, group, kv_view):
    if kv_view == "page" and page_size == 1:
        pytest.skip("with page size 1 the page view is the token view")
    case = make_case(ALL_SCENARIOS[scenario], page_size=page_size, num_qo_heads=2 * group, num_kv_heads=2,
                     head_dim=head_dim, dtype=dtype, device="cuda", seed=page_size + group)
    check_backend("flashinfer", case, BOUND[dtype], kv_view=kv_view)


@requires_flashinfer
@pytest.mark.parametrize("kv_view", ["token", "page"])
@pytest.mark.parametrize("dtype, head_dim, group", FLASHINFER_OTHER)
@pytest.mark.parametrize("scenario", ["decode", "extend_with_prefix", "mixed_short_long"])
def test_flashinfer_other_dtypes_and_dims(flashinfer_compiled, scenario, dtype, head_dim, group, kv_view):
    case = make_case(SCENARIOS[scenario], page_size=16, num_qo_heads=2 * group, num_kv_heads=2,
                     head_dim=head_dim, dtype=dtype, device="cuda", seed=group)
    check_backend("flashinfer", case, BOUND[dtype], kv_view=kv_view)


# ------------------------------------------------------------------------------------ shared
@requires_flashinfer
@requires_triton
@pytest.mark.parametrize("kv_view", ["token", "page"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("scenario", ["decode", "long_decode"])
def test_flashinfer_decode_on_a_staged_batch_plans_its_page_lists(flashinfer_compiled, scenario, page_size, kv_view):
    """A decode batch KVBackend's stager built with the backend's page lists: the backend plans
    those (no build of its own) and matches the dense reference."""
    from kvplug.attention.decode_staging import DecodeStager

    case = make_case(ALL_SCENARIOS[scenario], page_size=page_size, num_qo_heads=16, num_kv_heads=8, head_dim=128,
                     dtype=torch.bfloat16, device="cuda", seed=11 + page_size)
    backend = kvplug.create_attention_backend("flashinfer", case.config(kv_view=kv_view))
    stager = DecodeStager(case.page_table, torch.zeros_like(case.page_table), page_size=page_size,
                          page_list_size=backend.decode_page_list_size)
    rows = np.array(case.rows, dtype=np.int64)
    cached = np.array([c for c, _ in case.lens], dtype=np.int64)
    batch = stager.stage(rows, cached)
    assert batch.page_lists.view_page_size == (page_size if kv_view == "page" else 1)
    expected_pool = case.expected_pool()
    backend.prepare_metadata(batch)
    assert batch.metadata.indices is batch.page_lists.indices
    out = backend.forward(case.q, case.k, case.v, case.layer_id, batch)
    torch.cuda.synchronize()
    error = relative_error(out, case_reference(case))
    assert error < BOUND[torch.bfloat16], f"relative error {error:.2e}"
    assert torch.equal(case.pool.kv_buffer, expected_pool)


def _available(name: str) -> bool:
    return {"triton": importable("triton"), "flashinfer": importable("flashinfer")}[name]


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("page_size, chunk", [(1, 256), (16, 200), (64, 384)])
def test_chunked_prefill_equals_one_shot(request, backend, page_size, chunk):
    if not _available(backend):
        pytest.skip(f"needs {backend} (pip install -e \".[{backend}]\")")
    if backend == "flashinfer":
        request.getfixturevalue("flashinfer_compiled")
    totals = [1000, 430]
    case = make_case([(0, t) for t in totals], page_size=page_size, num_qo_heads=8, num_kv_heads=2, head_dim=128,
                     dtype=torch.bfloat16, device="cuda")
    attention = kvplug.create_attention_backend(backend, case.config())
    base = [0, totals[0]]
    outputs = torch.empty_like(case.q)
    chunks = [chunk_lens(t, chunk) for t in totals]
    for step in range(max(map(len, chunks))):
        live = [i for i in range(len(totals)) if step < len(chunks[i])]
        lens = [chunks[i][step] for i in live]
        batch = build_attention_batch(case.page_table, [case.rows[i] for i in live], [c for c, _ in lens],
                                      [d for _, d in lens], ForwardPhase.PREFILL)
        index = torch.cat([torch.arange(base[i] + c, base[i] + d) for i, (c, d) in zip(live, lens)]).cuda()
        attention.prepare_metadata(batch)
        out = attention.forward(case.q[index], case.k[index], case.v[index], case.layer_id, batch)
        outputs[index] = out.view(-1, *case.q.shape[1:])
    assert relative_error(outputs, case_reference(case)) < BOUND[torch.bfloat16]


@requires_triton
@requires_flashinfer
def test_hybrid_flashinfer_prefill_triton_decode(flashinfer_compiled):
    for scenario in ("extend_with_prefix", "decode"):
        case = make_case(SCENARIOS[scenario], page_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=128,
                         dtype=torch.bfloat16, device="cuda")
        check_backend("flashinfer,triton", case, BOUND[torch.bfloat16])


def test_auto_picks_the_best_installed(caplog):
    case = make_case(SCENARIOS["decode"], dtype=torch.bfloat16, device="cuda", num_qo_heads=4, num_kv_heads=2)
    with caplog.at_level(logging.INFO, logger="kvplug.attention.auto"):
        kvplug.create_attention_backend("auto", case.config())
    expected = "flashinfer" if importable("flashinfer") else "triton" if importable("triton") else "torch"
    assert f"chose '{expected}'" in caplog.text


def test_torch_backend_on_gpu_matches_reference():
    case = make_case(SCENARIOS["mixed_short_long"], page_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=128,
                     dtype=torch.bfloat16, device="cuda")
    check_backend("torch", case, BOUND[torch.bfloat16])


@pytest.mark.skipif(not importable("sgl_kernel"), reason="sgl-kernel is not installed (pip install -e '.[fa3]' on a "
                    "Hopper host; on kvplug's GPU machine scripts/device-fa3.sh brings it)")
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("scenario", sorted(ALL_SCENARIOS))
def test_fa3_matches_dense_reference(scenario, page_size):
    case = make_case(ALL_SCENARIOS[scenario], page_size=page_size, num_qo_heads=8, num_kv_heads=2, head_dim=128,
                     dtype=torch.bfloat16, device="cuda")
    check_backend("fa3", case, BOUND[torch.bfloat16])
