"""A real ``redis-server`` on 127.0.0.1 for the shared-KV-store tests (Debian package ``redis-server``)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from contextlib import contextmanager

REDIS_SERVER = shutil.which("redis-server")
SKIP_REASON = "redis-server is not installed (apt-get install -y redis-server)"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def redis_server(*extra: str, port: int | None = None):
    """A fresh server, nothing persisted; yields ``(port, process)`` and stops it afterwards."""
    port = port or free_port()
    process = subprocess.Popen(
        [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port} (exit {process.poll()})") from None
                time.sleep(0.02)
        yield port, process
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=10)
