#!/usr/bin/env bash
# The fa3 attention backend on the GPU machine: sglang-kernel (the wheel that carries FlashAttention-3
# as sgl_kernel.flash_attn) moved there by scripts/device-wheel-chunks.sh, then fa3's attention tests
# (decode / extend / mixed against the dense reference, page 1, 16 and 64), its CUDA-graph tests
# (capture / replay against eager) and `kvplug bench attention` with fa3 beside triton and, when
# FlashInfer's wheels are carried in .whl/, flashinfer (same run). Logs: $OUT/fa3.log.
#   usage (last chunk's call): bash scripts/device-fa3.sh .whl-chunks/part-NN
# sglang-kernel 0.4.5 is the release SGLang 0.5.17 pins beside torch 2.11.0, the GPU machine's torch;
# it links libcudart.so.13 / libnvrtc.so.13 as that torch (+cu130) does. Later releases pin torch 2.13+.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/device-fa3-out}
mkdir -p "$OUT"
log=$OUT/fa3.log
{
  wheel=$(bash scripts/device-wheel-chunks.sh receive "${1:?the last part folder}" | sed -n 's/^complete: //p')
  [ -n "$wheel" ] || { echo "device-fa3: the wheel is not complete yet"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sgksite "$wheel" || exit 1
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  fi
} 2>&1 | tee "$log" || exit 1
export PYTHONPATH=$PWD:/tmp/sgksite:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
python3 -c "import torch, sgl_kernel; from sgl_kernel.flash_attn import flash_attn_with_kvcache; print('torch', torch.__version__, '| sgl_kernel', sgl_kernel.__version__)" 2>&1 | tee -a "$log" || exit 1
timeout -k 5 "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_attention_gpu.py tests/test_graphs_gpu.py -k fa3 2>&1 | tee -a "$log"
backends=fa3,triton  # the bench times each beside FlashInfer called directly: it needs .whl/
python3 -c "import flashinfer" 2>/dev/null && backends=fa3,flashinfer,triton
timeout -k 5 "${BENCH_TIMEOUT:-200}" python3 -m kvplug bench attention --backends "$backends" --out "$OUT/attention_fa3.json" 2>&1 | tee -a "$log"
