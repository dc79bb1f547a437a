"""``ExitDeadline``: ``kvplug serve`` leaves within ``--shutdown-timeout`` of the stop signal, whatever
its teardown does.

The bounded stop (``server._shutdown``) times the requests, the worker and the HTTP thread, but
what follows is not its to bound: dropping the model (``ModelManager.shutdown``: a garbage
collection over everything the load left), the last statistics, closing the KV event publisher.
Under load these took the stop past the timeout (issue 29: 13.9 s against 10). Armed when the stop
begins, the deadline exits the process (flushing the log first) with the code the stop would have
ended with if it is still running then; ``serve`` disarms it on its way out.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time

logger = logging.getLogger("kvplug.serve")
EXIT_MARGIN_S = 0.25  # before the deadline: the process's own exit takes this much at most
TEARDOWN_SHARE = 0.2  # of the timeout, at most TEARDOWN_MAX_S, kept for what follows the bounded stop
TEARDOWN_MAX_S = 1.0


def teardown_reserve(timeout: float) -> float:
    """The part of ``--shutdown-timeout`` left after the bounded stop for the teardown."""
    return min(TEARDOWN_MAX_S, timeout * TEARDOWN_SHARE)


class ExitDeadline:
    """Exits the process at a deadline unless disarmed first (one arming per instance)."""

    def __init__(self) -> None:
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def arm(self, deadline: float, exit_code: int) -> None:
        """Exit with ``exit_code`` at ``deadline`` (``time.monotonic()`` seconds) minus ``EXIT_MARGIN_S``."""
        with self._lock:
            if self._timer is not None:
                return
            delay = max(deadline - time.monotonic() - EXIT_MARGIN_S, 0.0)
            self._timer = threading.Timer(delay, self._exit, args=(exit_code,))
            self._timer.name = "kvplug-exit-deadline"
            self._timer.daemon = True
            self._timer.start()

    def disarm(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()

    @staticmethod
    def _exit(exit_code: int) -> None:
        running = sorted(t.name for t in threading.enumerate()
                         if t is not threading.current_thread() and t is not threading.main_thread() and t.is_alive())
        logger.warning("kvplug serve: still stopping at --shutdown-timeout; exiting now (%s still running)",
                       ", ".join(running) or "nothing else")
        for child in multiprocessing.active_children():  # the engine process (--engine-process) goes too
            child.kill()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
