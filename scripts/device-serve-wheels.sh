#!/usr/bin/env bash
# Fills .whl-serve/ (ignored by git) with what `kvplug serve` and `kvplug bench serve` need on the GPU
# machine beyond its own packages (Python 3.12, torch, transformers, pluggy there already): fastapi,
# uvicorn, openai, pydantic, accelerate, psutil, pyzmq, msgpack and their pure dependencies, plus
# py-spy for MODE=stream PROFILE=1 of scripts/device-serve-bench.sh. Wheels the machine has already
# (torch, triton, the CUDA libraries, numpy, transformers' own dependencies) are removed again, so
# the folder stays ~11 MB and never shadows the machine's versions. Carry it: carry [".whl-serve"].
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl-serve
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_5_x86_64 --platform any -d .whl-serve \
  fastapi uvicorn "openai>=1.98" "pydantic>=2" "accelerate>=1.1" psutil pyzmq msgpack py-spy
cd .whl-serve
# on the machine already: pulled in by accelerate and openai, never to shadow the machine's builds
rm -f torch-* nvidia_* triton-* numpy-* sympy-* mpmath-* networkx-* fsspec-* filelock-* jinja2-* markupsafe-* \
  setuptools-* huggingface_hub-* hf_xet-* pyyaml-* tqdm-* packaging-* safetensors-*
ls
du -sh .
