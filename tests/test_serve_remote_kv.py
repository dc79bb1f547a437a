"""``kvplug serve --remote-kv`` (issue 30): two real server processes and a real client on one
``redis-server`` (with a password); the second server's first request for the first one's prefix
loads it from the store, and answers as the first did."""

from __future__ import annotations

import signal
from contextlib import contextmanager
import urllib.request
import subprocess

import pytest

from tests.mooncake_server import INSTALLED as MOONCAKE_INSTALLED
from tests.mooncake_server import SKIP_REASON as MOONCAKE_SKIP_REASON
from tests.mooncake_server import mooncake_cluster
from tests.attention_reference import requires_cuda
from tests.redis_server import REDIS_SERVER, SKIP_REASON, redis_server
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
from kvplug.interface import InvalidArgumentError, UnknownComponentError
from kvplug.plugins import PluginManager

PASSWORD = "s3cret-pw"


def test_remote_kv_flag_is_validated_and_reaches_the_settings():
    manager = PluginManager(entry_points=False)

    def parse(*flags):
        return validate(build_parser().parse_args(["serve", *flags]), manager)

    url = f"redis://:{PASSWORD}@127.0.0.1:6379/0"
    options = parse("--host-memory", "1GiB", "--remote-kv", url)
    from kvplug_transformers.serve_options import ServeOptions

    serve_options = ServeOptions(**options)
    settings = serve_options.kvplug_settings()
    assert settings["remote_kv"] == url and settings["remote_kv_model"] == "kvplug-default"
    assert PASSWORD not in repr(serve_options)
    with pytest.raises(InvalidArgumentError, match="give --host-memory") as error:
        parse("--remote-kv", url)
    assert PASSWORD not in str(error.value)
    with pytest.raises(UnknownComponentError, match="kv_store .nosuchstore"):
        parse("--host-memory", "1GiB", "--remote-kv", "nosuchstore://x")


def _serve(port, url, cache_dir, log, device="auto", extra=()):  # noqa: F811
    args = ["serve", "--port", str(port), "--kv-memory", "1536KiB", "--max-seq-len", "256", "--page-size", "16",
            "--max-running-reqs", "2", "--host-memory", "16MiB", "--remote-kv", url, "--stats-interval", "1",
            "--device", device, *extra]
    return _run_kvplug(args, cache_dir, log)


def _stop(process, log):
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert "Traceback" not in output and PASSWORD not in output
    return output


@pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)
@pytest.mark.parametrize("device, second_args", [
    ("cpu", ()),
    # the prefetch at add_request runs in the engine process too (issue 30)
    pytest.param("cpu", ("--engine-process",), id="cpu-engine-process"),
    # a CUDA pool's store writes run on the writer thread; the first server drains them at exit
    pytest.param("cuda", (), marks=[pytest.mark.gpu, requires_cuda]),
])
def test_a_second_server_loads_the_first_ones_prefix_from_the_store(device, second_args, server_deps, cache_dir,  # noqa: F811
                                                                     tmp_path):
    openai = server_deps
    topics = ["paged attention", "radix trees", "CUDA graphs", "pinned memory", "prefix caching"]
    prompts = [f"Question {number} about {topic}: " + f"explain {topic}. " * 5 for number, topic in enumerate(topics)]
    with redis_server("--requirepass", PASSWORD) as (redis_port, _):
        url = f"redis://:{PASSWORD}@127.0.0.1:{redis_port}/0"
        first_port, first_log = _free_port(), tmp_path / "first.log"
        first = _serve(first_port, url, cache_dir, first_log, device)
        try:
            stats = _wait_ready(first, first_port, first_log)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{first_port}/v1", api_key="unused", timeout=120)
            answers = {}
            for prompt in prompts:  # each pushes earlier ones out of the small pool, to host memory and the store
                reply = client.chat.completions.create(
                    model=stats["model"], messages=[{"role": "user", "content": prompt}], max_tokens=4)
                answers[prompt] = reply.choices[0].message.content
            first_stats = _stats(first_port)
            assert first_stats["host_write_backs"] > 0 and first_stats["remote_written_pages"] > 0, first_stats
            assert first_stats["remote_errors"] == 0 and first_stats["remote_hit_tokens"] == 0
        finally:
            output = _stop(first, first_log)
        assert f"redis://***@127.0.0.1:{redis_port}/0" in output

        second_port, second_log = _free_port(), tmp_path / "second.log"
        second = _serve(second_port, url, cache_dir, second_log, device, second_args)
        try:
            stats = _wait_ready(second, second_port, second_log)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{second_port}/v1", api_key="unused", timeout=120)
            reply = client.chat.completions.create(
                model=stats["model"], messages=[{"role": "user", "content": prompts[0]}], max_tokens=4)
            after = _stats(second_port)
            assert reply.choices[0].message.content == answers[prompts[0]]  # greedy: same answer from stored KV
            # the second server never evicted anything: a host hit here came from the store
            assert after["host_write_backs"] == 0 and after["host_hit_tokens"] >= 64, after
            assert after["remote_hit_tokens"] >= 64 and after["remote_errors"] == after["remote_corrupt_pages"] == 0
            # read when the request was queued (add_request), not by the admission on the batching thread
            assert after["remote_prefetches"] >= 1 and after["remote_blocking_reads"] == 0, after
            assert after["remote_prefetch_hit_tokens"] == after["remote_hit_tokens"], after
        finally:
            _stop(second, second_log)


def _ask(port, model, prompt, openai):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=4).choices[0].message.content


@contextmanager
def _store(kind, tmp_path):
    """(url, kill) of a real store on 127.0.0.1: a password-protected redis-server or a Mooncake cluster."""
    if kind == "redis":
        with redis_server("--requirepass", PASSWORD) as (redis_port, redis):
            def kill():
                redis.kill()
                redis.wait()
            yield f"redis://:{PASSWORD}@127.0.0.1:{redis_port}/0", kill
    else:
        with mooncake_cluster(tmp_path) as cluster:
            yield cluster.url, cluster.kill_master


@pytest.mark.parametrize("kind", [
    pytest.param("redis", marks=pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)),
    pytest.param("mooncake", marks=pytest.mark.skipif(not MOONCAKE_INSTALLED, reason=MOONCAKE_SKIP_REASON)),
])
def test_two_live_servers_share_the_store_and_outlive_it(kind, server_deps, cache_dir, tmp_path):  # noqa: F811
    """Both servers up at once on one store, against a server without it: the second's first
    request for the first's prefix is a store hit with the recompute's tokens; the store killed
    mid-run, both keep answering (every request 200, the same tokens) and count the faults."""
    openai = server_deps
    topics = ["page tables", "host memory", "RESP pipelining", "BLAKE2b keys", "write-through", "tail latency"]
    prompts = [f"Topic {number}, {topic}: " + f"describe {topic} again. " * 5 for number, topic in enumerate(topics)]
    with _store(kind, tmp_path) as (url, kill_store):
        ports = {name: _free_port() for name in ("reference", "first", "second")}
        logs = {name: tmp_path / f"{name}.log" for name in ports}
        reference_args = ["serve", "--port", str(ports["reference"]), "--kv-memory", "1536KiB", "--max-seq-len", "256",
                          "--page-size", "16", "--max-running-reqs", "2", "--stats-interval", "1"]
        processes = {"reference": _run_kvplug(reference_args, cache_dir, logs["reference"])}
        processes.update({name: _serve(ports[name], url, cache_dir, logs[name]) for name in ("first", "second")})
        try:
            model = {name: _wait_ready(processes[name], ports[name], logs[name])["model"] for name in ports}["first"]
            expected = {prompt: _ask(ports["reference"], model, prompt, openai) for prompt in prompts}
            for prompt in prompts[:4]:  # each pushes earlier ones out of the first's small pool, to the store
                assert _ask(ports["first"], model, prompt, openai) == expected[prompt]
            written = _stats(ports["first"])
            assert written["remote_written_pages"] > 0 and written["remote_errors"] == 0, written

            assert _ask(ports["second"], model, prompts[0], openai) == expected[prompts[0]]  # token-identical
            hit = _stats(ports["second"])
            assert hit["host_write_backs"] == 0 and hit["remote_hit_tokens"] >= 64, hit
            assert hit["remote_errors"] == hit["remote_corrupt_pages"] == 0

            kill_store()  # mid-run: both servers are up, the first holds prefixes the second has not read
            for name, prompt in [("second", prompts[1]), ("first", prompts[4]), ("second", prompts[5]),
                                 ("first", prompts[5]), ("first", prompts[0])]:
                assert _ask(ports[name], model, prompt, openai) == expected[prompt], (name, prompt)
            for name in ("first", "second"):
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[name]}/health", timeout=10) as response:
                    assert response.status == 200
                after = _stats(ports[name])
                assert after["remote_errors"] > 0, (name, after)  # the faults are counted, not raised
                assert after["remote_corrupt_pages"] == 0
            assert _stats(ports["second"])["remote_hit_tokens"] == hit["remote_hit_tokens"]  # nothing more loaded
        finally:
            for name, process in processes.items():
                _stop(process, logs[name])  # exit 0, no traceback, no password in the log
