"""``python tests/serve_with_slow_teardown.py SECONDS serve ...``: ``kvplug serve`` whose model drop
at the end of the stop (transformers' ``ModelManager.shutdown``: a garbage collection over the
whole model under load) takes SECONDS, so a test sees whether the stop still ends in time."""

from __future__ import annotations

import sys
import time

from transformers.cli.serving.model_manager import ModelManager

from kvplug.cli import main


def slow_teardown(seconds: float) -> None:
    shutdown = ModelManager.shutdown

    def slow_shutdown(self):
        time.sleep(seconds)
        shutdown(self)

    ModelManager.shutdown = slow_shutdown


if __name__ == "__main__":
    slow_teardown(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
