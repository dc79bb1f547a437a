"""``kvplug serve --host-memory``: a real server process and a real client; prefixes pushed out of a
small KV pool come back from host memory, answers are unchanged, ``/kvplug/stats`` reports both tiers."""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.test_serve import (  # noqa: F401  (fixtures)
    _free_port,
    _run_kvplug,
    _stats,
    _wait_ready,
    cache_dir,
    embedded,
    server_deps,
)
from kvplug.cli import build_parser
from kvplug.cli.serve import validate
from kvplug.interface import InvalidArgumentError
from kvplug.plugins import PluginManager


def test_host_memory_flag_is_validated_and_reaches_the_settings():
    from kvplug_transformers.serve_options import ServeOptions

    manager = PluginManager(entry_points=False)
    parse = lambda *argv: build_parser().parse_args(["serve", *argv])  # noqa: E731
    options = validate(parse("--host-memory", "2GiB"), manager)
    assert ServeOptions(**options).kvplug_settings()["host_memory"] == 2 << 30
    assert validate(parse(), manager)["host_memory"] is None
    with pytest.raises(InvalidArgumentError, match="--host-memory must be a size"):
        validate(parse("--host-memory", "plenty"), manager)
    with pytest.raises(InvalidArgumentError, match="--host-memory: prefix cache 'naive' takes no host_memory option"):
        validate(parse("--host-memory", "1GiB", "--prefix-cache", "naive"), manager)
    # with the native backend it is accepted, dropped and named (one command line for both sides of an A/B)
    native = validate(parse("--host-memory", "1GiB", "--kv-backend", "native"), manager)
    assert native["host_memory"] is None and native["ignored_flags"] == (
        "--host-memory configures kvplug's cache: ignored with --kv-backend native (transformers' own cache)",)


def test_serve_with_host_memory_loads_evicted_prefixes_back(server_deps, cache_dir, tmp_path):  # noqa: F811
    openai = server_deps
    port, log = _free_port(), tmp_path / "serve.log"
    args = ["serve", "--port", str(port), "--kv-memory", "1536KiB", "--max-seq-len", "256", "--page-size", "16",
            "--max-running-reqs", "2", "--host-memory", "16MiB", "--stats-interval", "1"]
    process = _run_kvplug(args, cache_dir, log)
    try:
        stats = _wait_ready(process, port, log)
        assert stats["host_hit_tokens"] == 0
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        topics = ["paged attention", "radix trees", "CUDA graphs", "pinned memory", "prefix caching"]
        prompts = [f"Question {number} about {topic}: " + f"explain {topic}. " * 5
                   for number, topic in enumerate(topics)]
        answers = {}
        for prompt in prompts:  # each pushes earlier ones out of the small pool
            reply = client.chat.completions.create(
                model=stats["model"], messages=[{"role": "user", "content": prompt}], max_tokens=4)
            answers[prompt] = reply.choices[0].message.content
        before = _stats(port)
        assert before["evicted_tokens"] > 0 and before["host_write_backs"] > 0 and before["host_pages"] > 0
        again = client.chat.completions.create(
            model=stats["model"], messages=[{"role": "user", "content": prompts[0]}], max_tokens=4)
        after = _stats(port)
        assert again.choices[0].message.content == answers[prompts[0]]  # greedy: same answer from loaded KV
        assert after["host_hit_tokens"] - before["host_hit_tokens"] >= 64 and after["host_loads"] > before["host_loads"]
        assert after["host_loaded_bytes"] > 0 and after["host_hit_rate"] > 0
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert "host tier" in output and "Traceback" not in output
    # the tier's size is in the start-up log, next to the pool's (issue 29 item 9)
    assert "kvplug host-memory tier: 16,777,216 bytes (16.0 MiB) under the radix cache, about" in output
