#!/bin/bash
# The CPU a streaming `kvplug serve --engine-process` spends per output token in its HTTP process
# (and its engine process), beside another commit's, in one `kvplug bench serve` run (issue 28):
# the embedded model, 128 random prompts x 64 output tokens, 128 streaming clients.
#   BASE=<commit>     the other side, checked out with git archive into /tmp (none: this checkout only)
#   ARGS=...          extra `kvplug serve` arguments of both sides
#   EXTRA=...         extra `kvplug serve` arguments of this checkout's side only
#   BENCH_ARGS=...    extra `kvplug bench serve` arguments (e.g. --num-prompts 256 --output-tokens 256)
#   OUT=file.json     where the JSON goes (default /tmp/serve-cpu-per-token.json)
# Prints, per side, "server CPU per output token: HTTP process X us, engine processes Y us".
set -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/serve-cpu-per-token.json}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
export PYTHONPATH=$ROOT:$ROOT/adapters/transformers${PYTHONPATH:+:$PYTHONPATH}
COMMON="--log-level warning --engine-process ${ARGS:-}"
SIDES=()
if [ -n "${BASE:-}" ]; then
  OLD=/tmp/kvplug-base-$(git -C "$ROOT" rev-parse --short "$BASE") || exit 1
  [ -d "$OLD" ] || { mkdir -p "$OLD" && git -C "$ROOT" archive "$BASE" | tar -x -C "$OLD"; } || exit 1
  SIDES+=(--serve-args "PYTHONPATH=$OLD:$OLD/adapters/transformers $COMMON")
fi
SIDES+=(--serve-args "$COMMON ${EXTRA:-}")
# from a neutral directory: `python -m kvplug` would import the current directory's kvplug first
cd /tmp && exec python3 -m kvplug bench serve "${SIDES[@]}" --dataset random --num-prompts 128 --max-concurrency 128 \
    --output-tokens 64 ${BENCH_ARGS:-} --out "$OUT"
