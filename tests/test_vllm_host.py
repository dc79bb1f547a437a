"""vLLM 0.32.0 (its CPU build) with kvplug's prefix cache: ``LLM(...)`` engines, token ids compared with
native vLLM (its own prefix caching on) on a tiny random model built here.

Each engine runs in its own interpreter (``tests/vllm_llm_run.py``; vLLM keeps process-wide state)
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor. CPU blocks are 128 tokens, so
the prompts are several hundred tokens long and share 1–3 blocks. About five minutes in all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test-vllm-host.sh builds its environment)")
pytest.importorskip("kvplug_vllm", reason="kvplug-vllm is not installed (pip install -e adapters/vllm)")

import kvplug  # noqa: E402

from tests.vllm_models import build_model  # noqa: E402

RUNNER = Path(__file__).with_name("vllm_llm_run.py")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("vllm-model") / "tiny-llama")


_runs: dict[tuple[str, str, str], dict] = {}


def run_engine(model_dir: Path, workload: str, cache: str, tmp_path: Path, extra: dict | None = None) -> dict:
    """The runner's JSON result for one engine (kept per workload, cache and ``extra`` (more
    ``kv_connector_extra_config``) for the session)."""
    key = (workload, cache, json.dumps(extra or {}, sort_keys=True))
    if key not in _runs:
        out = tmp_path / f"{workload}-{cache}-{len(_runs)}.json"
        # this checkout's kvplug and adapter first (an installed editable copy may be another checkout)
        path = os.pathsep.join([str(ROOT), str(ROOT / "adapters" / "vllm"), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=path)
        config = json.dumps({"workload": workload, "cache": cache, "extra": extra or {}})
        done = subprocess.run([sys.executable, str(RUNNER), str(model_dir), config, str(out)], env=env,
                              capture_output=True, text=True, timeout=540)
        assert done.returncode == 0, f"engine {key} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        _runs[key] = json.loads(out.read_text())
    return _runs[key]


CACHES = ["radix", "naive"] + (["page-hash"] if "page-hash" in kvplug.available("prefix_cache") else [])


@pytest.mark.parametrize("cache", CACHES)
def test_tokens_identical_to_native_vllm(model_dir: Path, tmp_path: Path, cache: str) -> None:
    native = run_engine(model_dir, "identity", "native", tmp_path)
    ours = run_engine(model_dir, "identity", cache, tmp_path)
    assert ours["manager"] == "KvplugKVCacheManager" and native["manager"] == "KVCacheManager"
    for round_ours, round_native in zip(ours["rounds"], native["rounds"]):
        assert round_ours["tokens"] == round_native["tokens"]
    assert ours["salted"]["tokens"] == native["salted"]["tokens"]
    assert ours["pool_hash_entries"] == 0  # vLLM's own hash index stayed empty
    assert native["rounds"][1]["cached"] and all(native["rounds"][1]["cached"])  # the workload can hit
    stats = ours["kvplug"]
    reported = sum(sum(r["cached"]) for r in ours["rounds"]) + sum(ours["salted"]["cached"])
    assert stats["hit_tokens"] == reported  # every cached token vLLM reports is a kvplug hit
    if cache == "naive":
        assert reported == 0 and stats["cached_tokens"] == 0
        return
    # the repeated prompts hit their whole shared prefix and more; a new cache_salt starts cold
    assert all(cached >= 256 for cached in ours["rounds"][1]["cached"])
    assert ours["salted"]["cached"][0] == 0 and stats["namespaces"] == 2
    assert ours["reset"] is True and ours["after_reset"]["cached_tokens"] == 0
    assert ours["after_reset"]["free_blocks"] == ours["after_reset"]["num_blocks"] - 1  # null block


def test_preemption_and_chunked_prefill_keep_blocks_conserved(model_dir: Path, tmp_path: Path) -> None:
    """A pool of 40 blocks for 16 requests of 1–3 blocks decoding 240 tokens each: vLLM preempts, kvplug
    evicts the shortage; conservation is checked after every scheduling step by the runner."""
    native = run_engine(model_dir, "pressure", "native", tmp_path)
    ours = run_engine(model_dir, "pressure", "radix", tmp_path)
    for round_ours, round_native in zip(ours["rounds"], native["rounds"]):
        assert round_ours["tokens"] == round_native["tokens"]
    assert ours["checks"]["preemptions"] > 0 and native["checks"]["preemptions"] > 0
    assert ours["checks"]["steps"] > 100
    stats = ours["kvplug"]
    assert stats["evictions"] > 0 and stats["evicted_tokens"] > 0 and stats["hit_tokens"] > 0
    assert stats["reused_lookups"] > 0  # waiting requests' repeated lookups answered without matching
    assert stats["protected_tokens"] == 0 and stats["running_with_hits"] == 0
