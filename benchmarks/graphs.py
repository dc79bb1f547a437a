"""Eager vs CUDA-graph decode step of a 28-layer model-shaped stack (same as ``kvplug bench graphs``; CUDA).

    python benchmarks/graphs.py [--out out.json] [--quick] ...
"""

from __future__ import annotations

import sys

from kvplug.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "graphs", *sys.argv[1:]]))
