#!/usr/bin/env bash
# Builds the SGLang-host test environment as an SGLang user has it, and runs the SGLang tests in it.
#
# SGLang 0.5.23 with the versions it pins: its wheel's own requirements, read from its metadata,
# installed at their pins (torch==2.14.1, transformers==5.19.0, xgrammar==0.2.7, ...), plus
# torchvision 0.29.1, torch 2.14.1's release, which SGLang requires unpinned and imports when it
# loads its model configs (without it SGLang's plugin loader fails: "No module named 'torchvision'").
#
# torch: a CPU build of 2.14.1 exists only on PyTorch's own index, which this project's machines
# cannot reach; PyPI's torch 2.14.1 for Linux x86_64 is the CUDA build (about 5.5 GB installed,
# here taken from the machine's local wheel store, about one minute). It runs on the CPU, and it
# is the torch `pip install sglang==0.5.23` gives every SGLang user, so that is what is tested.
#
# Not installed: the requirements in GPU_ONLY below, CUDA/GPU kernels and media codecs that no
# CPU code path imports (each with its reason). SGLang itself is therefore installed last with
# --no-deps, so pip never tries to pull them; then the script checks, from the same metadata, that
# every other requirement is installed at a version SGLang accepts and that exactly GPU_ONLY is
# missing (pip prints no dependency-resolver error at any step).
#
# Then: `launch_server --help` must list kvplug's flags (the plugin loaded), and pytest runs
# tests/test_sglang_host.py, tests/test_sglang_graphs.py (the decode CUDA-graph hooks, eagerly;
# test_sglang_graphs_gpu.py skips here: no CUDA), tests/test_sglang_kv_events.py and
# tests/test_sglang_server.py (real servers on tiny random models, about four minutes), and the
# faulty-plugin tests (tests/test_sglang_cache_faults.py, tests/test_sglang_server_cache_faults.py).
#   usage: bash scripts/test-sglang-host.sh [VENV_DIR]   (default: $TMPDIR/kvplug-sglang-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-${TMPDIR:-/tmp}/kvplug-sglang-venv}"
SGLANG_VERSION=0.5.23
TORCH_PINS="torch==2.14.1 torchvision==0.29.1"
GPU_ONLY=(
  "cuda-python: CUDA driver bindings"
  "flash-attn-4: CUDA attention kernels"
  "flashinfer-python: CUDA attention kernels (kvplug's own flashinfer backend is optional)"
  "humming-kernels: CUDA kernels"
  "nvidia-cutlass-dsl: CUDA kernel DSL"
  "nvidia-mathdx: CUDA math libraries"
  "nvshmem4py-cu13: multi-GPU communication"
  "quack-kernels: CUDA kernels"
  "sgl-deep-ep: multi-GPU expert parallelism"
  "sgl-deep-gemm: CUDA GEMM kernels"
  "sgl-flash-mla: CUDA MLA kernels"
  "sglang-kernel: SGLang's CUDA kernels (its CPU build is not on PyPI)"
  "tilelang: GPU kernel compiler"
  "torch-memory-saver: CUDA memory hooks"
  "torchaudio: built against torch 2.11; audio models only"
  "torchcodec: video decoding (needs FFmpeg); multimodal models only"
)
start=$(date +%s)
phase() { echo "test-sglang-host: $1 ($(( $(date +%s) - start )) s)"; }

rm -rf "$venv"
python3 -m venv "$venv"
py="$venv/bin/python"
pip="$py -m pip"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
printf '%s\n' $TORCH_PINS > "$work/constraints.txt"

phase "torch and torchvision at SGLang's pin"
$pip install -q $TORCH_PINS
$pip download -q --no-deps -d "$work" "sglang==$SGLANG_VERSION"
wheel="$(ls "$work"/sglang-"$SGLANG_VERSION"-*.whl)"

# SGLang's requirements (no extras) as the installer evaluates them, less GPU_ONLY and torch's pair
gpu_names="$(printf '%s\n' "${GPU_ONLY[@]}" | cut -d: -f1)"
$py - "$wheel" "$work/requirements.txt" "$gpu_names" <<'PY'
import re, sys, zipfile
from pip._vendor.packaging.requirements import Requirement
wheel, out, gpu = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
with zipfile.ZipFile(wheel) as archive:
    meta = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
    lines = archive.read(meta).decode().splitlines()
kept = []
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    requirement = Requirement(line.split(":", 1)[1].strip())
    if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
        continue
    name = re.sub(r"[-_.]+", "-", requirement.name).lower()
    if name in gpu or name in ("torch", "torchvision"):
        continue
    requirement.marker, requirement.extras = None, set()
    kept.append(str(requirement))
open(out, "w").write("\n".join(kept) + "\n")
PY
phase "SGLang's $(wc -l < "$work/requirements.txt") other requirements at its pins"
$pip install -q -c "$work/constraints.txt" -r "$work/requirements.txt"
phase "kvplug, kvplug-sglang and the example third-party cache plugin"
$pip install -q -c "$work/constraints.txt" -e ".[test]" -e ./adapters/sglang -e ./examples/third_party_plugin
phase "sglang==$SGLANG_VERSION itself (--no-deps: its GPU-only requirements stay out)"
$pip install -q --no-deps "$wheel"

# every requirement SGLang declares is installed at a version it accepts, except exactly GPU_ONLY
$py - "$gpu_names" <<'PY'
import re, sys
from importlib import metadata
from pip._vendor.packaging.requirements import Requirement
gpu = set(sys.argv[1].split())
missing, wrong = set(), []
for line in metadata.requires("sglang") or []:
    requirement = Requirement(line)
    if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
        continue
    name = re.sub(r"[-_.]+", "-", requirement.name).lower()
    try:
        version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        missing.add(name)
        continue
    if not requirement.specifier.contains(version, prereleases=True):
        wrong.append(f"{requirement} (installed {version})")
problems = []
if wrong:
    problems.append("installed outside SGLang's pins: " + ", ".join(wrong))
if missing != gpu:
    problems.append(f"missing {sorted(missing - gpu)}; expected missing but installed {sorted(gpu - missing)}")
if problems:
    sys.exit("test-sglang-host: " + "; ".join(problems))
print(f"test-sglang-host: every requirement of SGLang at its pins, but the {len(gpu)} GPU-only ones")
PY

phase "plugin check: launch_server --help"
help="$("$py" -m sglang.launch_server --help 2>&1)" || { echo "$help" | tail -20; exit 1; }
for flag in --kv-backend --prefix-cache --kvplug-attention --kvplug-host-memory; do
  grep -q -- "$flag" <<<"$help" || { echo "test-sglang-host: launch_server --help lacks $flag" >&2; echo "$help" | grep -i -B2 -A8 "plugin" >&2; exit 1; }
done

rm -rf "$work" && trap - EXIT  # exec replaces this shell: clean up first
phase "environment ready; tests"
# SGLang's SWIG-built dependency warns at interpreter shutdown ("sys:1: DeprecationWarning"); keep
# pytest's summary the last line of the run
PYTHONWARNINGS="ignore::DeprecationWarning:sys" exec "$py" -m pytest -q -p no:cacheprovider \
  tests/test_sglang_host.py tests/test_sglang_graphs.py tests/test_sglang_graphs_gpu.py tests/test_sglang_kv_events.py \
  tests/test_sglang_server.py tests/test_sglang_host_tier.py tests/test_sglang_host_tier_gpu.py \
  tests/test_sglang_server_host_tier.py tests/test_sglang_cache_faults.py tests/test_sglang_server_cache_faults.py \
  tests/test_sglang_tiered_cache_faults.py tests/test_sglang_server_tiered_cache_faults.py \
  tests/test_sglang_remote_kv.py tests/test_sglang_server_remote_kv.py
