"""Decode attention, store_kv and host metadata benchmark (same as ``kvplug bench attention``; CUDA).

    python benchmarks/attention.py [--backends flashinfer,triton] [--out out.json] [--quick] ...
"""

from __future__ import annotations

import sys

from kvplug.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "attention", *sys.argv[1:]]))
