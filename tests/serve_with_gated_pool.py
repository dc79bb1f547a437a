"""``python tests/serve_with_gated_pool.py GATE serve ...``: ``kvplug serve`` whose KV cache build
waits until the file GATE exists, so a test sees the server while it is still starting (no timing)."""

from __future__ import annotations

import os
import sys
import time

from kvplug.cli import main
from kvplug_transformers.paged_cache import KVPlugPagedCache


def gate_pool_build(gate: str) -> None:
    build = KVPlugPagedCache.__init__

    def gated_build(self, *args, **kwargs):
        while not os.path.exists(gate):
            time.sleep(0.05)
        build(self, *args, **kwargs)

    KVPlugPagedCache.__init__ = gated_build


if __name__ == "__main__":
    gate_pool_build(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
