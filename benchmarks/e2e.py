"""End-to-end serving benchmark through the transformers host (same as ``kvplug bench e2e``).

    python benchmarks/e2e.py [--quick] [--device cuda] [--model-shape qwen3-0.6b] [--out e2e.json]

Radix vs naive (kvplug) vs native (transformers' own cache) on shared-prefix, no-prefix and
multi-turn workloads; ``--help`` lists every size flag. Plot the JSON with ``benchmarks/plot.py``.
"""

from __future__ import annotations

import sys

from kvplug.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "e2e", *sys.argv[1:]]))
