#!/usr/bin/env bash
# SGLang decode CUDA graphs with kvplug attention, on the GPU machine: tests/test_sglang_graphs_gpu.py
# (kvplug's SGLang graph hooks captured in real CUDA graphs and replayed against eager, triton and
# torch, flashinfer when importable, page sizes 1 and 16).
#
# SGLang 0.5.23 travels as wheels in .whl-sglang/ (filled on a networked machine with SGLang's wheel
# and the pure-Python packages its attention-backend, forward-batch, memory-pool and graph-runner
# modules import, about 63 MB; carry it with the device tool). They are installed with --no-deps into
# /tmp/sgsite. sgl-kernel (over 350 MB, built for another torch) cannot travel:
# tests/sglang_gpu_support holds test-only import placeholders for the names SGLang imports from it
# (and for IPython / torchvision, absent there); see its README. Output: $OUT/log.
#   usage (on the GPU machine, repository root): bash scripts/device-sglang-graphs.sh [LAST_PART]
# With FlashInfer 0.7.2 (SGLang 0.5.23's pin, a 65 MB wheel): tar SGLang's wheels with FlashInfer's
# (flashinfer-python 0.7.2, cuda-tile, tabulate, click, nvidia-cudnn-frontend, nvidia-cutlass-dsl),
# move the tar with scripts/device-wheel-chunks.sh and pass the last part's folder: the completed
# tar is unpacked into .whl-sglang/ first.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/device-sglang-graphs-out}
mkdir -p "$OUT"
{
  if [ -n "${1:-}" ]; then
    tar_path=$(bash scripts/device-wheel-chunks.sh receive "$1" | sed -n 's/^complete: //p')
    [ -n "$tar_path" ] || { echo "device-sglang-graphs: the wheel tar is not complete yet"; exit 1; }
    mkdir -p .whl-sglang && tar -xf "$tar_path" -C .whl-sglang || exit 1
  fi
  ls .whl-sglang/*.whl > /dev/null || { echo "device-sglang-graphs: no wheels in .whl-sglang/"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sgsite .whl-sglang/*.whl || exit 1
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/log" || exit 1
export PYTHONPATH="$PWD/tests/sglang_gpu_support:/tmp/sgsite:$PWD:$PWD/adapters/sglang${PYTHONPATH:+:$PYTHONPATH}"
timeout -k 5 "${TEST_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider -rs tests/test_sglang_graphs_gpu.py tests/test_sglang_host_tier_gpu.py 2>&1 \
  | tee -a "$OUT/log"
