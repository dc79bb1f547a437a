"""``python tests/serve_with_gated_capture.py GATE RECORD serve ...``: ``kvplug serve`` whose worker
warm-up (``KVPlugPagedCache.capture_decode_graphs``, the decode CUDA graphs' capture) waits until
the file GATE exists and appends the thread it ran on to RECORD, so a test sees the server while
it is still capturing (no timing) and where the capture ran."""

from __future__ import annotations

import os
import sys
import threading
import time

from kvplug.cli import main
from kvplug_transformers.paged_cache import KVPlugPagedCache


def gate_capture(gate: str, record: str) -> None:
    capture = KVPlugPagedCache.capture_decode_graphs

    def gated_capture(self, model):
        with open(record, "a") as file:
            file.write(threading.current_thread().name + "\n")
        while not os.path.exists(gate):
            time.sleep(0.05)
        capture(self, model)

    KVPlugPagedCache.capture_decode_graphs = gated_capture


if __name__ == "__main__":
    gate_capture(sys.argv[1], sys.argv[2])
    sys.exit(main(sys.argv[3:]))
