"""A real ``kvplug serve`` process for the serve tests: started on a free port of 127.0.0.1 with
the embedded model, read through its log, stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def kvplug_env(cache_dir: Path) -> dict:
    env = dict(os.environ, KVPLUG_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def start(argv: list[str], cache_dir: Path, log: Path, max_open_files: int | None = None) -> subprocess.Popen:
    """``python <argv...>`` (``-m kvplug serve ...`` or a wrapper script), output into ``log``;
    ``max_open_files``: the process's ``ulimit -n``."""
    def limit_files() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))

    with open(log, "wb") as sink:
        return subprocess.Popen(
            [sys.executable, *argv], stdout=sink, stderr=subprocess.STDOUT, env=kvplug_env(cache_dir),
            preexec_fn=limit_files if max_open_files is not None else None,
        )


def get_json(port: int, path: str, timeout: float = 10, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def auth(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def post(port: int, path: str, body: bytes, headers: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        text = error.read()
        try:
            return error.code, json.loads(text)
        except ValueError:
            return error.code, {"raw": text.decode(errors="replace")}


def wait_ready(process: subprocess.Popen, port: int, log: Path, api_key: str | None = None) -> dict:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"kvplug serve exited with {process.returncode} before serving:\n{log.read_text()[-4000:]}")
        try:
            status, stats = get_json(port, "/kvplug/stats", timeout=5, headers=auth(api_key))
            if status == 200:
                return stats
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail(f"kvplug serve did not answer within {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def stop(process: subprocess.Popen, timeout: float = 30) -> tuple[int, float]:
    """SIGTERM; (exit code, seconds it took). Kills it and fails when it overruns ``timeout``."""
    if process.poll() is not None:
        return process.returncode, 0.0
    start_time = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"kvplug serve did not exit within {timeout} s of SIGTERM")
    return code, time.monotonic() - start_time
