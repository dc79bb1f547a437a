#!/bin/bash
# A real `kvplug serve` on the GPU machine, decode steps replayed from kvplug's CUDA graphs: the
# embedded model on CUDA, 12 concurrent chat requests with the real openai client (streaming and
# not), one over-long prompt, /kvplug/stats, then SIGTERM. Needs the server's wheels in
# .whl-serve/ (fastapi, uvicorn, openai, pydantic, typer, rich and their dependencies for Python
# 3.12, downloaded with `pip download --only-binary=:all: --python-version 3.12 ...`), carried to
# the machine. Logs and a summary go to $OUT.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/device-serve-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-serve .whl-serve/*.whl || exit 1
export PYTHONPATH=/tmp/site-serve${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation -e . -e ./adapters/transformers > "$OUT/install.log" 2>&1 || {
    tail -5 "$OUT/install.log"; exit 1; }
PORT=8300
timeout -k 5 150 python3 -m kvplug serve --port $PORT --max-running-reqs 16 --max-seq-len 512 \
    --cuda-graph-max-bs 16 --log-level info > "$OUT/serve.log" 2>&1 &
SERVER=$!
timeout 90 python3 - "$PORT" <<'PY' 2>&1 | tee "$OUT/client.log"
import json, sys, time, threading, urllib.request
port = sys.argv[1]
base = f"http://127.0.0.1:{port}"
for _ in range(180):
    try:
        urllib.request.urlopen(base + "/health", timeout=2); break
    except Exception:
        time.sleep(0.5)
from openai import OpenAI
client = OpenAI(base_url=base + "/v1", api_key="none")
model = client.models.list().data[0].id
started = time.perf_counter()
results = []
def chat(i):
    if i % 3 == 0:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"count {i}"}],
                                                max_tokens=48, stream=True, temperature=0)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        results.append(("stream", len(text)))
    else:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"count {i}"}],
                                               max_tokens=48, temperature=0)
        results.append((reply.choices[0].finish_reason, reply.usage.completion_tokens))
threads = [threading.Thread(target=chat, args=(i,)) for i in range(12)]
[t.start() for t in threads]; [t.join() for t in threads]
print(f"12 concurrent chats in {time.perf_counter() - started:.2f} s: {sorted(results, key=str)}")
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x " * 600}], max_tokens=4)
    print("over-long prompt: ACCEPTED (wrong)")
except Exception as error:
    print(f"over-long prompt refused: {type(error).__name__}: {str(error)[:160]}")
stats = json.loads(urllib.request.urlopen(base + "/kvplug/stats", timeout=5).read())
print("stats:", {key: stats.get(key) for key in ("cache_hit_tokens", "finished_requests", "running_requests", "used_pages")})
PY
kill -TERM $SERVER; wait $SERVER; echo "server exit code: $?" | tee -a "$OUT/client.log"
grep -E "captured|CUDA graph|ERROR|Traceback|Error" "$OUT/serve.log" | head -10
