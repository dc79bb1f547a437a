"""The main job in one script: start ``kvplug serve`` on the embedded default model, send one chat
completion with the real ``openai`` client, show kvplug's cache statistics, then stop the server.

    python examples/serve_and_chat.py [--port 8000] [extra kvplug serve flags...]

The embedded model has random weights: the reply is not meaningful text, the plumbing is the point.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.request

import openai

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--port", type=int, default=8000)
args, serve_flags = parser.parse_known_args()
base = f"http://127.0.0.1:{args.port}"

server = subprocess.Popen([sys.executable, "-m", "kvplug", "serve", "--port", str(args.port), *serve_flags])
try:
    deadline = time.monotonic() + 300
    while True:  # the first start builds the embedded model and caches it on disk
        if server.poll() is not None:
            raise SystemExit(f"kvplug serve exited with code {server.returncode}")
        try:
            stats = json.load(urllib.request.urlopen(f"{base}/kvplug/stats", timeout=2))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit("kvplug serve did not come up within 300 s") from None
            time.sleep(1)

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    model = client.models.list().data[0].id  # the served name: kvplug-default for the embedded model
    print(f"serving {model!r}")
    for attempt in range(2):  # the second request hits kvplug's prefix cache
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hello to kvplug."}],
            max_tokens=16,
            temperature=0,
        )
        print(f"reply {attempt + 1}: {reply.choices[0].message.content!r}")
    print("kvplug stats:", json.dumps(json.load(urllib.request.urlopen(f"{base}/kvplug/stats")), indent=2))
finally:
    server.send_signal(signal.SIGTERM)  # stops within --shutdown-timeout (10 s), exit code 0
    server.wait(timeout=60)
