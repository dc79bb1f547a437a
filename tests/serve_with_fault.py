"""``python tests/serve_with_fault.py STEP serve ...``: ``kvplug serve`` whose batching worker
raises at its STEP-th forward step, as a bug in a model or a kernel would. The serve tests use it to
check what the server does when its worker dies anyway: nothing in kvplug itself is changed."""

from __future__ import annotations

import sys

from kvplug.cli import main
from kvplug_transformers.paged_cache import KVPlugPagedCache


def inject_fault(at_step: int) -> None:
    forward = KVPlugPagedCache.attention_forward
    steps = {"count": 0}

    def failing_forward(self, layer_id, q, k, v, scaling):
        if layer_id == 0:
            steps["count"] += 1
            if steps["count"] == at_step:
                raise RuntimeError(f"injected fault at forward step {at_step}")
        return forward(self, layer_id, q, k, v, scaling)

    KVPlugPagedCache.attention_forward = failing_forward


if __name__ == "__main__":
    inject_fault(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
