"""Prefix-cache latency benchmark, side by side with SGLang's RadixCache when it imports.

Same as ``kvplug bench prefix-cache``; run it inside the SGLang anchor venv to get the ratios::

    python benchmarks/prefix_cache.py [--out FILE.json] [--page-sizes 1,16] [--quick]
"""

from __future__ import annotations

import sys

from kvplug.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "prefix-cache", *sys.argv[1:]]))
