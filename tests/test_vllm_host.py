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


_runs: dict[tuple, dict] = {}


def start_engine(model_dir: Path, workload: str, cache: str, out: Path, extra: dict | None = None,
                 events: bool = False, inputs: dict | None = None) -> subprocess.CompletedProcess:
    # this checkout's kvplug and kvplug-vllm, whatever the environment has installed
    path = [str(ROOT), str(ROOT / "adapters" / "vllm"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=os.pathsep.join(filter(None, path)))
    config = json.dumps({"workload": workload, "cache": cache, "extra": extra or {}, "events": events,
                         "inputs": inputs or {}})
    return subprocess.run([sys.executable, str(RUNNER), str(model_dir), config, str(out)], env=env,
                          capture_output=True, text=True, timeout=540)


def run_engine(model_dir: Path, workload: str, cache: str, tmp_path: Path, extra: dict | None = None,
               events: bool = False, inputs: dict | None = None) -> dict:
    """The runner's JSON result for one engine (kept per workload, cache, extra config, events and
    inputs for the module)."""
    key = (workload, cache, json.dumps(extra or {}, sort_keys=True), events, json.dumps(inputs or {}, sort_keys=True))
    if key not in _runs:
        out = tmp_path / f"{workload}-{cache}-{len(_runs)}.json"
        done = start_engine(model_dir, workload, cache, out, extra, events, inputs)
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


HOST = {"host_memory": "8MiB"}  # 64 pages of one 128-token block of every layer (1 KiB of KV per token)


def test_evicted_prefixes_come_back_from_host_memory(model_dir: Path, tmp_path: Path) -> None:
    """16 prompts with their own 3-block heads through a pool of 40 blocks, twice: without a host tier
    the second round finds nothing (the first round's prefixes were evicted), with one it loads every
    head from host memory; tokens identical to native vLLM, conservation checked after every step."""
    native = run_engine(model_dir, "host", "native", tmp_path)
    device_only = run_engine(model_dir, "host", "radix", tmp_path)
    ours = run_engine(model_dir, "host", "radix", tmp_path, HOST)
    for round_ours, round_native in zip(ours["rounds"], native["rounds"]):
        assert round_ours["tokens"] == round_native["tokens"]
    assert device_only["rounds"][1]["cached"] == [0] * 16 and native["rounds"][1]["cached"] == [0] * 16
    assert ours["rounds"][0]["cached"] == [0] * 16
    assert ours["rounds"][1]["cached"] == [384] * 16  # vLLM counts the loaded tokens as cached
    stats = ours["kvplug"]
    assert stats["host_hits"] == 16 and stats["host_hit_tokens"] == 16 * 384 == stats["host_loaded_tokens"]
    assert stats["host_write_backs"] > 0 and stats["host_written_tokens"] >= stats["host_loaded_tokens"]
    assert stats["host_pages"] == 64 and stats["hit_tokens"] == 0  # the hits were host hits only
    assert ours["checks"]["steps"] > 30
    assert stats["protected_tokens"] == 0 and stats["host_protected_tokens"] == 0
    after = ours["after_reset"]
    assert ours["reset"] is True and after["host_free_pages"] == 64 and after["free_blocks"] == after["num_blocks"] - 1


@pytest.mark.parametrize(("host_memory", "message"), [
    ("1B", "host_memory=1 bytes holds no KV page of 131,072 bytes"),
    ("1000TiB", "of host memory are available; lower --host-memory"),
])
def test_a_bad_host_memory_is_one_startup_error(model_dir: Path, tmp_path: Path, host_memory: str,
                                                message: str) -> None:
    done = start_engine(model_dir, "host", "radix", tmp_path / "never.json", {"host_memory": host_memory})
    assert done.returncode != 0 and not (tmp_path / "never.json").exists()
    assert message in done.stderr, done.stderr[-3000:]


def test_host_tier_under_preemption_and_chunked_prefill(model_dir: Path, tmp_path: Path) -> None:
    """The pressure workload with a host tier of 16 pages (it fills up and drops its oldest pages):
    host hits are loaded into preempted and chunked requests' blocks; tokens identical to native."""
    native = run_engine(model_dir, "pressure", "native", tmp_path)
    ours = run_engine(model_dir, "pressure", "radix", tmp_path, {"host_memory": "2MiB"})
    for round_ours, round_native in zip(ours["rounds"], native["rounds"]):
        assert round_ours["tokens"] == round_native["tokens"]
    assert ours["checks"]["preemptions"] > 0 and ours["checks"]["steps"] > 100
    stats = ours["kvplug"]
    assert stats["host_pages"] == 16 and stats["host_hits"] > 0 and stats["host_write_backs"] > stats["host_hits"]
    assert stats["protected_tokens"] == 0 and stats["running_with_hits"] == 0 and stats["host_protected_tokens"] == 0
