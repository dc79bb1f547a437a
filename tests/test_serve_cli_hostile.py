"""``kvplug serve`` / ``kvplug capacity`` arguments and files that used to end in a traceback or a
hang (issue 33 item 7): each is a one-line error and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvplug.cli import main
from tests.serve_process import REPO_ROOT, free_port, kvplug_env

GEOMETRY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "8"]


def _refused(capsys, argv: list[str], words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("flag", ["--kv-memory", "--host-memory", "--max-request-bytes"])
def test_serve_sizes_past_any_float_are_refused(capsys, flag):
    _refused(capsys, ["serve", flag, "1e400"], flag)


def test_capacity_sizes_past_any_float_are_refused(capsys):
    _refused(capsys, ["capacity", *GEOMETRY, "--memory", "1e400"], "--memory")
    _refused(capsys, ["capacity", *GEOMETRY, "--memory", "1GiB", "--host-memory", "1e400"], "--host-memory")


@pytest.mark.parametrize("argv, words", [
    (["serve", "--stats-interval", "nan"], "--stats-interval"),
    (["serve", "--stats-interval", "inf"], "--stats-interval"),
    (["serve", "--timeout-header", "0"], "--timeout-header"),
    (["serve", "--timeout-body", "nan"], "--timeout-body"),
    (["serve", "--stream-stall-timeout", "-1"], "--stream-stall-timeout"),
    (["serve", "--timeout-keep-alive", "inf"], "--timeout-keep-alive"),
    (["serve", "--shutdown-timeout", "nan"], "--shutdown-timeout"),
    (["serve", "--limit-concurrency", "0"], "--limit-concurrency"),
    (["serve", "--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
    (["capacity", *GEOMETRY, "--q-heads", "0", "--memory", "1GiB"], "--q-heads"),
    (["capacity", "--layers", "0", "--kv-heads", "2", "--head-dim", "8", "--memory", "1GiB"], "--layers"),
])
def test_numbers_out_of_range_are_refused(capsys, argv, words):
    _refused(capsys, argv, words)


@pytest.mark.parametrize("content, words", [
    (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "nests deeper"),
    ('{"model_type": "qwen3", "name": "caf\u00e9"}'.encode("latin-1"), "not UTF-8"),
    (b"[1, 2]", "must hold a JSON object"),
    (b"{not json", "not valid JSON"),
])
def test_bad_config_files_are_refused(capsys, tmp_path, content, words):
    (tmp_path / "config.json").write_bytes(content)
    _refused(capsys, ["serve", str(tmp_path)], words)
    _refused(capsys, ["capacity", str(tmp_path), "--memory", "1GiB"], words)


def test_capacity_does_not_read_devices(capsys):
    _refused(capsys, ["capacity", "/dev/zero", "--memory", "1GiB"], "not a regular file")


def test_oversized_config_is_refused_without_reading_it_all(capsys, tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"x": "' + b"a" * (17 << 20) + b'"}')
    _refused(capsys, ["capacity", str(tmp_path), "--memory", "1GiB"], "over 16,777,216 bytes")


def _serve(argv: list[str], cache_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvplug", "serve", *argv], capture_output=True, text=True, timeout=120,
        env=kvplug_env(cache_dir), cwd=REPO_ROOT,
    )


def test_device_meta_and_a_model_without_tokenizer_fail_at_start(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    from kvplug_transformers.embedded_model import ensure_embedded_model

    model = ensure_embedded_model(tmp_path / "cache")
    meta = _serve(["--device", "meta", "--port", str(free_port())], tmp_path / "cache")
    assert meta.returncode == 2 and "--device" in meta.stderr and "Traceback" not in meta.stderr, meta.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (bare / name).write_bytes((model / name).read_bytes())
    result = _serve([str(bare), "--port", str(free_port())], tmp_path / "cache")
    assert result.returncode == 2 and "tokenizer" in result.stderr and "Traceback" not in result.stderr, \
        result.stderr[-3000:]
    assert json.loads((bare / "config.json").read_text())  # the checkpoint itself was untouched
