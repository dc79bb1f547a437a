#!/usr/bin/env bash
# A fleet of real `kvplug serve` workers routed by NVIDIA Dynamo's KV router (issue 27).
#
# Dynamo's CPU-only standalone services (`python -m dynamo.indexer`, `python -m dynamo.select_service`)
# come from ai-dynamo-runtime 1.6.1 (a 75 MB abi3 wheel). It pins pydantic (<= 2.13.5), so it lives in
# an environment of its own, built here when missing (a READY file marks a finished one). The full
# `ai-dynamo` package is not installed: it depends on a stub that downloads from a vendor index.
#
# The workers run in the environment this script is started from ($PYTHON, default `python`: the one
# with kvplug, its transformers adapter and the events extra, e.g. .ci/run's); tests/test_dynamo_fleet.py
# starts two of them with --kv-events-config, Dynamo's indexer and selection service on 127.0.0.1
# (both listen on 0.0.0.0 without authentication: run this on a machine you trust), and checks that a
# conversation's next turn is selected for the worker holding it, and that a flush, an eviction and a
# restart leave no stale score.
#
# With KVPLUG_SGLANG_PYTHON set to the Python of an SGLang environment (scripts/test-sglang-host.sh
# builds one; .ci/run builds it in an earlier step and passes it), tests/test_dynamo_sglang_fleet.py
# does the same with two real SGLang servers on kvplug (tiny random models, a few requests); without
# it that file is skipped, saying why.
#   usage: [KVPLUG_SGLANG_PYTHON=...] bash scripts/test-dynamo-fleet.sh [DYNAMO_VENV]   (default: $TMPDIR/kvplug-dynamo-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-${TMPDIR:-/tmp}/kvplug-dynamo-venv}"
python="${PYTHON:-python}"
DYNAMO_VERSION=1.6.1
start=$(date +%s)
phase() { echo "test-dynamo-fleet: $1 ($(( $(date +%s) - start )) s)"; }

if [ ! -f "$venv/READY" ]; then
  phase "building $venv: ai-dynamo-runtime==$DYNAMO_VERSION"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q "ai-dynamo-runtime==$DYNAMO_VERSION"
  touch "$venv/READY"
fi
found="$("$venv/bin/python" -c "import importlib.metadata as m, dynamo.llm; print(m.version('ai-dynamo-runtime'))")"
[ "$found" = "$DYNAMO_VERSION" ] || { echo "test-dynamo-fleet: $venv has ai-dynamo-runtime $found, expected $DYNAMO_VERSION" >&2; exit 1; }
"$venv/bin/python" -m dynamo.indexer --help >/dev/null
"$python" -c "import kvplug_transformers, zmq, msgpack" || {
  echo "test-dynamo-fleet: $python needs kvplug, ./adapters/transformers and the events extra: pip install -e '.[test]' -e './adapters/transformers[test]'" >&2
  exit 1
}

if [ -n "${KVPLUG_SGLANG_PYTHON:-}" ]; then
  "$KVPLUG_SGLANG_PYTHON" -c "import sglang, kvplug_sglang" || {
    echo "test-dynamo-fleet: KVPLUG_SGLANG_PYTHON=$KVPLUG_SGLANG_PYTHON cannot import sglang and kvplug_sglang (bash scripts/test-sglang-host.sh builds that environment)" >&2
    exit 1
  }
fi

phase "Dynamo $DYNAMO_VERSION ready; tests"
KVPLUG_DYNAMO_PYTHON="$venv/bin/python" exec "$python" -m pytest -q -p no:cacheprovider tests/test_dynamo_fleet.py \
  tests/test_dynamo_sglang_fleet.py
