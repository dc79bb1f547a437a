#!/bin/bash
# The GPU check in ONE device call (with FlashInfer's wheels in .whl/, carried to the machine):
# FlashInfer warm-up in its own process, then the FlashInfer attention/graph tests, the
# transformers host on CUDA, the attention / graphs / e2e benchmarks. Logs go to $OUT/*.log, a
# summary to $OUT/summary.txt. Every step has a timeout capped by a global deadline, so the call
# ends (with its logs) inside the 10-minute device limit.
#   FLASHINFER=0  skip everything FlashInfer (no wheels needed, no JIT compile: ~4 min saved)
#   TESTS=0       skip the GPU tests (benchmarks only)
#   SERVE_TESTS=1 also the `kvplug serve --device cuda` tests (carry .whl-serve/ and .redis-dev/)
#   BENCH=0       skip the attention / graphs / host-step benchmarks
#   E2E=0         skip the end-to-end benchmark; E2E=decode (default) runs the decode-heavy
#                 workload (256 requests, 256 output tokens, concurrency 64 and 256: kvplug with
#                 CUDA graphs, kvplug eager, transformers' native cache), E2E=shared the
#                 shared-prefix one (64 requests on one 2,048-token prefix, concurrency 64: radix,
#                 naive with and without the overlap, transformers' native cache), E2E=tier the
#                 host-memory tier (long-context-chat, working set 4x the pool: radix vs radix+host,
#                 plus the tier's copy bandwidth), E2E=tier0 its 0 %-hit overhead (one turn:
#                 evictions and write-backs, nothing reused), E2E=tier-ratios the same at working-set
#                 ratios 1,2,8; several at once: E2E=shared,tier0 (JSON: e2e_NAME.json)
#   SHAPE=qwen3-4b  the e2e model shape (default qwen3-0.6b)
#
# Rules this script keeps, learned the hard way (see tests/test_attention_gpu.py warm_up_flashinfer):
# - never two FlashInfer JIT builds at once: concurrent ninja runs in FlashInfer's shared
#   cached_ops dir corrupt .ninja_deps and the next run rebuilds everything; nothing that may
#   touch FlashInfer runs while the warm-up builds;
# - never reinstall the wheels over a warm cache: pip rewrites FlashInfer's headers with new
#   mtimes and ninja then rebuilds every object (hence the stamp below).
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/device-check-out}
mkdir -p "$OUT"
START=$(date +%s)
DEADLINE=${DEADLINE:-555}   # seconds after START by which every step has ended
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
elapsed() { echo $(( $(date +%s) - START )); }
note() { echo "[$(elapsed) s] $*" | tee -a "$SUMMARY"; }

# step NAME MAX_SECONDS COMMAND...: runs COMMAND under timeout min(MAX, time left), logs to $OUT/NAME.log
step() {
    local name=$1 cap=$2; shift 2
    local left=$(( DEADLINE - $(elapsed) ))
    local limit=$(( cap < left ? cap : left ))
    if (( limit < 15 )); then note "$name: SKIPPED (out of time)"; return 0; fi
    local t0; t0=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local verdict=ok; (( rc == 124 || rc == 137 )) && verdict="TIMED OUT after ${limit} s" || { (( rc != 0 )) && verdict="FAILED rc=$rc"; }
    note "$name: $verdict in $(( $(date +%s) - t0 )) s; $(grep -E ' in [0-9.]+s( \(.*\))?( =+)?$' "$OUT/$name.log" | tail -1)"
}

# ---------------------------------------------------------------- install (once per machine)
STAMP=/tmp/site/.kvplug-wheels.sha256
FLASHINFER=${FLASHINFER:-1}
if [ "$FLASHINFER" != 1 ]; then
    note "FlashInfer skipped (FLASHINFER=$FLASHINFER)"
elif sha256sum .whl/*.whl 2>/dev/null | cmp -s - "$STAMP"; then
    note "wheels already installed in /tmp/site"
else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { note "wheel install FAILED"; exit 1; }
    sha256sum .whl/*.whl > "$STAMP"
    note "wheels installed"
fi
export PYTHONPATH=$PWD:$PWD/adapters/transformers:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a "$SUMMARY"
PYTEST=(python3 -m pytest -q -rfEs -p no:cacheprovider)

# ---------------------------------------------------------------- warm-up || GPU tests without FlashInfer
# 'auto' resolves to flashinfer, so it waits for the warm-up with the flashinfer cases
TESTS=${TESTS:-1}
[ "$TESTS" = 1 ] && {
    step tf_host_other 150 "${PYTEST[@]}" tests/test_transformers_host.py -k "cuda and not flashinfer and not auto"
    step tests_gpu_other 300 "${PYTEST[@]}" tests/test_attention_gpu.py tests/test_graphs_gpu.py \
        tests/test_store_kv_gpu.py tests/test_page_lists_gpu.py tests/test_decode_staging_gpu.py tests/test_mha_pool.py \
        tests/test_radix_cache.py tests/test_backend.py tests/test_decode_step.py tests/test_decode_graphs.py \
        tests/test_host_tier.py tests/test_no_host_wait_gpu.py tests/test_transformers_host_tier.py \
        tests/test_vllm_layout_gpu.py tests/test_remote_kv_gpu.py -k "not flashinfer"
} &
OTHER=$!
[ "$FLASHINFER" = 1 ] && step warmup 280 python3 -c "
from tests.test_attention_gpu import warm_up_flashinfer
w = warm_up_flashinfer()
print(f'flashinfer warm-up {w.seconds:.1f} s, {len(w.modules)} modules, compiled late: {list(w.compiled_late)}')
print(*w.modules, sep='\n')"
[ "$FLASHINFER" = 1 ] && grep -E "^(flashinfer warm-up|RuntimeError|.*Error)" "$OUT/warmup.log" | tail -3 | tee -a "$SUMMARY"
wait $OTHER

# ---------------------------------------------------------------- FlashInfer tests (cache warm: no compiling)
[ "$FLASHINFER" = 1 ] && [ "$TESTS" = 1 ] && step tests_flashinfer 150 "${PYTEST[@]}" --durations=5 -o faulthandler_timeout=120 \
    tests/test_attention_gpu.py tests/test_graphs_gpu.py -k flashinfer

# ---------------------------------------------------------------- benchmarks
BACKENDS=triton; [ "$FLASHINFER" = 1 ] && BACKENDS=triton,flashinfer
BENCH=${BENCH:-1}  # BENCH=0: no attention / graphs / host-step benchmarks (GPU tests and e2e only)
[ "$BENCH" = 1 ] && [ "$FLASHINFER" = 1 ] && step bench_attention 80 python3 -m kvplug bench attention --repeats 5 --out "$OUT/attention.json"
[ "$BENCH" = 1 ] && step bench_graphs 70 python3 -m kvplug bench graphs --backends "$BACKENDS" --out "$OUT/graphs.json"
[ "$BENCH" = 1 ] && step bench_host_step 40 python3 -m kvplug bench host-step --device cuda --out "$OUT/host_step.json"
# the same suite on a baseline revision (BASELINE=dir holding its kvplug/), same machine, same run
if [ "$BENCH" = 1 ] && [ -n "${BASELINE:-}" ] && [ -d "$BASELINE/kvplug" ]; then
    # run from inside it: 'python -m' puts the working directory first on sys.path
    step bench_host_step_baseline 40 bash -c "cd '$BASELINE' && PYTHONPATH='$BASELINE':\$PYTHONPATH \
        python3 -m kvplug bench host-step --device cuda --out '$OUT/host_step_baseline.json'"
    [ "${BASELINE_GRAPHS:-0}" = 1 ] && step bench_graphs_baseline 70 bash -c "cd '$BASELINE' && PYTHONPATH='$BASELINE':\$PYTHONPATH \
        python3 -m kvplug bench graphs --out '$OUT/graphs_baseline.json'"
fi

# ---------------------------------------------------------------- transformers host with FlashInfer
# The bf16 cases build a head_dim-64 model (FlashInfer's sm90 prefill needs a multiple of 32);
# stop at the first failure rather than recompiling for every case.
[ "$FLASHINFER" = 1 ] && [ "$TESTS" = 1 ] && step tf_host_flashinfer 90 "${PYTEST[@]}" --maxfail=1 tests/test_transformers_host.py -k "cuda and (flashinfer or auto)"

# ---------------------------------------------------------------- end to end (last: takes what time is left)
# `kvplug bench e2e` finds the transformers host through its entry point: install both, editable
python3 -m pip install -q --no-deps --no-build-isolation -e . -e ./adapters/transformers > "$OUT/install_editable.log" 2>&1 \
    || note "editable install FAILED (see install_editable.log)"

# ---------------------------------------------------------------- kvplug serve on CUDA (SERVE_TESTS=1)
# real `kvplug serve --device cuda` processes: they need the server's wheels (.whl-serve/, carried) and,
# for the shared-store case, a redis-server (.redis-dev/bin + lib, carried: the binary and its libraries)
if [ "${SERVE_TESTS:-0}" = 1 ] && [ "$TESTS" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-serve .whl-serve/*.whl \
        > "$OUT/install_serve.log" 2>&1 || note "serve wheels install FAILED (see install_serve.log)"
    [ -d .redis-dev ] && export PATH=$PWD/.redis-dev/bin:$PATH LD_LIBRARY_PATH=$PWD/.redis-dev/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    PYTHONPATH=/tmp/site-serve:$PYTHONPATH step tests_serve_gpu 200 "${PYTEST[@]}" -m gpu tests/test_serve_graphs_gpu.py \
        tests/test_serve_native_sampling_gpu.py tests/test_serve_remote_kv.py
fi
# qwen3-0.6b shape, bf16, triton attention; a warm-up run per variant precedes the timed ones
E2E=${E2E:-decode}
SHAPE_ARGS=(); [ -n "${SHAPE:-}" ] && SHAPE_ARGS=(--model-shape "$SHAPE")
for workload in ${E2E//,/ }; do
  E2E_OUT=(--out "$OUT/e2e_$workload.json")
  if [ "$workload" = decode ]; then
    step bench_e2e_$workload 330 python3 -m kvplug bench e2e --device cuda --repeats 1 --workloads no-prefix \
        --requests 256 --system-tokens 16 --question-tokens 128 --output-tokens 256 --concurrency 64,256 \
        --attention triton --variants radix,radix:eager,native "${SHAPE_ARGS[@]}" "${E2E_OUT[@]}"
  elif [ "$workload" = shared ]; then
    step bench_e2e_$workload 330 python3 -m kvplug bench e2e --device cuda --repeats 2 --workloads shared-prefix \
        --requests 64 --system-prompts 1 --system-tokens 2048 --question-tokens 128 --output-tokens 32 \
        --concurrency 64 --max-batch-tokens 4096 --attention triton --variants radix,naive,naive:sync,native \
        "${SHAPE_ARGS[@]}" "${E2E_OUT[@]}"
  elif [ "$workload" = tier ] || [ "$workload" = tier0 ] || [ "$workload" = tier-ratios ]; then
    # 32 chats over their own 8,192-token contexts: working set ~283k tokens (32 GB of KV), host tier 1.25x
    TURNS=4; RATIOS=4; REPEATS=1
    [ "$workload" = tier0 ] && TURNS=1 && REPEATS=3
    [ "$workload" = tier-ratios ] && RATIOS=1,2,8
    step bench_e2e_$workload 330 python3 -m kvplug bench e2e --device cuda --workloads long-context-chat \
        --repeats $REPEATS --conversations 32 --turns $TURNS --system-tokens 8192 --question-tokens 128 --output-tokens 32 \
        --working-set-ratio $RATIOS --attention triton --variants radix,radix+host "${SHAPE_ARGS[@]}" "${E2E_OUT[@]}"
  elif [ "$workload" != 0 ]; then
    note "unknown E2E workload $workload"
  fi
done

# ---------------------------------------------------------------- summary
for name in tests_flashinfer tests_gpu_other tf_host_other tf_host_flashinfer tests_serve_gpu; do
    [ -f "$OUT/$name.log" ] && { echo "--- $name"; grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/$name.log" | tail -8; }
done | tee -a "$SUMMARY"
for name in bench_attention bench_graphs bench_graphs_baseline bench_host_step bench_host_step_baseline $(cd "$OUT" && ls bench_e2e_*.log 2>/dev/null | sed 's/.log$//'); do
    [ -f "$OUT/$name.log" ] && { echo "--- $name"; tail -25 "$OUT/$name.log"; }
done
note "total"
# the device tool brings back a handful of files: the logs travel as one archive
tar -czf "$OUT/logs.tar.gz" -C "$OUT" $(cd "$OUT" && ls *.log summary.txt) && (cd "$OUT" && rm -f *.log)
