#!/bin/bash
# `kvplug bench serve` on the GPU machine: a folder checkpoint of Qwen3-0.6B geometry (random bf16
# weights, the embedded model's byte-level tokenizer; logits of ids the tokenizer cannot decode are
# zeroed so every streamed chunk carries text) served by `kvplug serve` and by `kvplug serve
# --kv-backend native`, driven in one run through the openai client, streaming: multi-turn chats over
# a shared system prompt. Needs the server's wheels in .whl-serve/ (fastapi, uvicorn, openai,
# pydantic and their dependencies for Python 3.12), carried to the machine. Output: $OUT/serve.json.
#   KVPLUG_ARGS / NATIVE_ARGS  extra `kvplug serve` arguments of each side
#   BENCH_ARGS                 extra `kvplug bench serve` arguments
#   CLIENT_PROCS=1             `--client-processes` of every `kvplug bench serve` call (issue 28: whether the
#                              one client interpreter bounds streaming; "1 2": each server measured with both)
#   MODE=stream                issue 28: kvplug only, 512 random prompts x 256 tokens at concurrency 256,
#                              clients streaming and not, then `kvplug bench e2e` in-process, same call
#   MODE=sweep                 issue 28 items 3-4: multi-turn chats at concurrency $SWEEP (kvplug beside
#                              native; native only up to NATIVE_MAX_C) for benchmarks/plot_serve.py, then
#                              the shared-prefix e2e shape through the client: radix, naive, native
#   PROFILE=1                  MODE=stream: py-spy records every process of the streaming pass's server, from
#                              its start to its end (--subprocesses, per thread, idle included; the start-up's
#                              stacks are told apart by their frames): $OUT/profile_stream.txt (collapsed
#                              stacks; py-spy's wheel comes with scripts/device-serve-wheels.sh)
#   API_SERVERS="2 4"          MODE=stream: one more streaming pass per N with --api-server-count N
#                              (N HTTP processes over one engine process): $OUT/serve_stream_api<N>.json
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/device-serve-bench-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-serve .whl-serve/*.whl || exit 1
export PYTHONPATH=/tmp/site-serve${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation -e . -e ./adapters/transformers > "$OUT/install.log" 2>&1 || {
    tail -5 "$OUT/install.log"; exit 1; }
CKPT=/tmp/qwen3-0.6b-geometry
[ -f "$CKPT/config.json" ] || python3 - "$CKPT" <<'PY' || exit 1
import sys, torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
from kvplug.bench.e2e_model import MODEL_SHAPES
from kvplug_transformers import embedded_model
shape = MODEL_SHAPES["qwen3-0.6b"]
tokenizer = embedded_model.build_tokenizer()
config = Qwen3Config(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                     num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
                     num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim, vocab_size=shape.vocab_size,
                     max_position_embeddings=shape.max_position_embeddings, tie_word_embeddings=True,
                     eos_token_id=embedded_model.EOS_TOKEN_ID, pad_token_id=embedded_model.PAD_TOKEN_ID,
                     torch_dtype="bfloat16")
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
with torch.no_grad():
    model.get_input_embeddings().weight[len(tokenizer):].zero_()  # undecodable ids never win
model.generation_config = GenerationConfig(eos_token_id=embedded_model.EOS_TOKEN_ID,
                                           pad_token_id=embedded_model.PAD_TOKEN_ID, do_sample=False)
model.save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
print("checkpoint written to", sys.argv[1])
PY
COMMON="--max-seq-len 4096 --log-level warning"
if [ "${MODE:-ab}" = sweep ]; then
  for c in ${SWEEP:-16 64 256}; do
    native=(); [ "$c" -le "${NATIVE_MAX_C:-64}" ] && native=(--serve-args "$CKPT $COMMON --kv-backend native")
    timeout 300 python3 -m kvplug bench serve \
        --serve-args "$CKPT $COMMON --attention triton --max-running-reqs 256 --cuda-graph-max-bs 256 ${KVPLUG_ARGS:-}" \
        "${native[@]}" --dataset multi-turn --conversations "$c" --turns 3 --system-chars 2000 \
        --question-chars 100 --output-tokens 64 --max-concurrency "$c" --warmup 8 \
        --client-processes ${CLIENT_PROCS:-1} ${BENCH_ARGS:-} \
        --out "$OUT/serve_multi_turn_c$c.json" 2>&1 | tail -14 | tee "$OUT/bench_c$c.log"
  done
  timeout 200 python3 -m kvplug bench serve \
      --serve-args "$CKPT $COMMON --attention triton --max-running-reqs 64 --cuda-graph-max-bs 64" \
      --serve-args "$CKPT $COMMON --attention triton --max-running-reqs 64 --cuda-graph-max-bs 64 --prefix-cache naive" \
      --serve-args "$CKPT $COMMON --kv-backend native" \
      --dataset shared-prefix --num-prompts 64 --system-chars 2048 --question-chars 128 --output-tokens 32 \
      --max-concurrency 64 --warmup 4 --client-processes ${CLIENT_PROCS:-1} --out "$OUT/serve_shared_prefix.json" \
      2>&1 | tail -14 | tee "$OUT/bench_shared.log"
  exit 0
fi
if [ "${MODE:-ab}" = stream ]; then
  # issue 28: one kvplug server config, clients streaming and not, beside the in-process figure
  ARGS="$CKPT $COMMON --attention triton --max-running-reqs 256 --cuda-graph-max-bs 256 ${KVPLUG_ARGS:-}"
  for pass in stream nostream; do
    flag=""; [ "$pass" = nostream ] && flag=--no-stream
    if [ "${PROFILE:-0}" = 1 ] && [ "$pass" = stream ]; then  # sample the server from its start to its end
      ( for _ in $(seq 1 60); do pid=$(pgrep -of "kvplug serve $CKPT") && break; sleep 1; done
        [ -n "${pid:-}" ] && timeout 230 /tmp/site-serve/bin/py-spy record --subprocesses --threads --idle -r 100 \
            -d 220 -f raw -o "$OUT/profile_stream.txt" -p "$pid" > "$OUT/profile_stream.log" 2>&1 ) &
    fi
    timeout 240 python3 -m kvplug bench serve --serve-args "$ARGS" --dataset random --num-prompts 512 \
        --question-chars 128 --output-tokens 256 --max-concurrency 256 --warmup 16 $flag \
        --client-processes ${CLIENT_PROCS:-1} ${BENCH_ARGS:-} \
        --out "$OUT/serve_$pass.json" 2>&1 | tail -20 | tee "$OUT/bench_$pass.log"
  done
  for count in ${API_SERVERS:-}; do  # issue 28: the HTTP side over N processes
    timeout 240 python3 -m kvplug bench serve --serve-args "$ARGS --api-server-count $count" --dataset random \
        --num-prompts 512 --question-chars 128 --output-tokens 256 --max-concurrency 256 --warmup 16 \
        --client-processes ${CLIENT_PROCS:-1} ${BENCH_ARGS:-} --out "$OUT/serve_stream_api$count.json" 2>&1 \
        | tail -20 | tee "$OUT/bench_stream_api$count.log"
  done
  timeout 200 python3 -m kvplug bench e2e --device cuda --repeats 1 --workloads no-prefix --requests 512 \
      --system-tokens 16 --question-tokens 128 --output-tokens 256 --concurrency 256 --attention triton \
      --variants radix --out "$OUT/e2e_inprocess.json" 2>&1 | tail -12 | tee "$OUT/e2e.log"
  exit 0
fi
timeout 500 python3 -m kvplug bench serve \
    --serve-args "$CKPT $COMMON --attention triton --max-running-reqs 64 --cuda-graph-max-bs 64 ${KVPLUG_ARGS:-}" \
    --serve-args "$CKPT $COMMON --kv-backend native ${NATIVE_ARGS:-}" \
    --dataset multi-turn --conversations 48 --turns 3 --system-chars 2000 --question-chars 100 \
    --output-tokens 64 --max-concurrency 48 --client-processes ${CLIENT_PROCS:-1} ${BENCH_ARGS:-} \
    --out "$OUT/serve.json" 2>&1 | tee "$OUT/bench.log"
cp /tmp/kvplug-bench-serve-*.log "$OUT/" 2>/dev/null
