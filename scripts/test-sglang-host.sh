#!/usr/bin/env bash
# Builds the SGLang-host test environment and runs tests/test_sglang_host.py in it.
#
# SGLang 0.5.23 needs transformers >= 5.18 while the transformers host pins 5.17, so the SGLang
# host is tested in a virtual environment of its own: CPU torch 2.13.0, kvplug and the
# kvplug-sglang adapter, SGLang without its (CUDA) dependencies, and the small packages that the
# SGLang modules the tests import need — each pinned, with torch held at 2.13.0.
#   usage: bash scripts/test-sglang-host.sh [VENV_DIR]   (default: $TMPDIR/kvplug-sglang-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-${TMPDIR:-/tmp}/kvplug-sglang-venv}"
rm -rf "$venv"
python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
constraints="$(mktemp)"
echo "torch==2.13.0" > "$constraints"
$pip install -q torch==2.13.0
$pip install -q -c "$constraints" -e ".[test]" -e ./adapters/sglang
$pip install -q --no-deps sglang==0.5.23
$pip install -q -c "$constraints" numpy==2.4.6 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 \
  triton==3.8.0 pillow==13.0.0 starlette==1.10.0 msgspec==0.23.0 pydantic==2.14.4 pyzmq==27.3.0 tqdm==4.70.1 \
  ipython==9.18.1 aiohttp==3.14.5 transformers==5.19.0 dill==0.4.1 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 \
  compressed-tensors==0.18.0 gguf==0.19.0 openai==2.8.0 partial-json-parser==0.2.1.1.post7 einops==0.8.2
rm -f "$constraints"
# SGLang's SWIG-built dependency warns at interpreter shutdown ("sys:1: DeprecationWarning"); keep
# pytest's summary the last line of the run
PYTHONWARNINGS="ignore::DeprecationWarning:sys" "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_sglang_host.py
