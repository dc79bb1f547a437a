"""A real Mooncake Store on 127.0.0.1 for the shared-KV-store tests: ``mooncake_master`` (with its
HTTP metadata server) and one ``mooncake_client`` lending the cluster its memory, both from
``mooncake-transfer-engine-non-cuda`` (``bash scripts/install-mooncake.sh``)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from tests.redis_server import free_port


def _binary(name: str) -> str | None:
    beside = Path(sys.executable).parent / name  # the venv's bin: the console scripts of the wheel
    return str(beside) if beside.exists() else shutil.which(name)


MASTER, CLIENT = _binary("mooncake_master"), _binary("mooncake_client")
INSTALLED = importlib.util.find_spec("mooncake") is not None and MASTER is not None and CLIENT is not None
SKIP_REASON = ("Mooncake is not installed (bash scripts/install-mooncake.sh: libibverbs1 and "
               "mooncake-transfer-engine-non-cuda==0.3.13.post1)")


class MooncakeCluster:
    """A master and one memory-lending client; ``url`` is what kvplug is given."""

    def __init__(self, logs: Path, segment: str) -> None:
        self.rpc_port, self.metadata_port, self.metrics_port, self.client_port = (free_port() for _ in range(4))
        self.logs, self.segment = logs, segment
        self.master: subprocess.Popen | None = None
        self.client: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return (f"mooncake://127.0.0.1:{self.rpc_port}"
                f"?metadata_server=http://127.0.0.1:{self.metadata_port}/metadata")

    def start(self) -> None:
        self.master = self._spawn("master", [
            MASTER, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_port={self.metrics_port}"])
        _wait_port(self.rpc_port, self.master, "mooncake_master")
        _wait_port(self.metadata_port, self.master, "mooncake_master's metadata server")
        self.client = self._spawn("client", [
            CLIENT, "--host=127.0.0.1", f"--port={self.client_port}", f"--master_server_address=127.0.0.1:{self.rpc_port}",
            f"--metadata_server=http://127.0.0.1:{self.metadata_port}/metadata", f"--global_segment_size={self.segment}",
            "--protocol=tcp"])
        _wait_port(self.client_port, self.client, "mooncake_client")

    def wait_writable(self, timeout: float = 20) -> None:
        """Until a page can be stored: the lending client's segment mounts after it registers."""
        from kvplug.interface import KVStoreConfig
        from kvplug.kv_store.mooncake_store import MooncakeKVStore

        store = MooncakeKVStore(KVStoreConfig(self.url))
        deadline = time.monotonic() + timeout
        try:
            while store.put([f"probe-{time.monotonic_ns()}"], [b"probe"]) != 1:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Mooncake cluster at {self.url} took no page in {timeout} s")
                time.sleep(0.2)
        finally:
            store.close()

    def kill_master(self) -> None:
        if self.master is not None and self.master.poll() is None:
            self.master.kill()
            self.master.wait(timeout=10)

    def stop(self) -> None:
        for process in (self.client, self.master):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"mooncake-{name}.log", "ab")
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "GLOG_logtostderr": "1"})


def _wait_port(port: int, process: subprocess.Popen, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not listen on {port} (exit {process.poll()})") from None
            time.sleep(0.05)


@contextmanager
def mooncake_cluster(logs: Path, segment: str = "256MB"):
    cluster = MooncakeCluster(logs, segment)
    try:
        cluster.start()
        cluster.wait_writable()
        yield cluster
    finally:
        cluster.stop()
