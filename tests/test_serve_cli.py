"""``kvplug serve`` flags (issue 18 items 1-5, 8): the MODEL positional, vLLM / SGLang aliases,
every flag combination checked with a message naming the flag and the rule, the ``serve`` usage on
a bad flag, the component list in ``--help``, the port checked before the model loads, and one
log format governed by ``--log-level``."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import pytest
import torch

from kvplug.cli import build_parser
from kvplug.cli.serve import check_port_free, validate
from kvplug.interface import InvalidArgumentError, KVPlugError
from kvplug.plugins import PluginManager
from tests.serve_process import free_port, get_json, kvplug_env, start, stop, wait_ready


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture(scope="module")
def manager():
    return PluginManager(entry_points=False)


@pytest.fixture()
def checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_model_positional_and_its_aliases(manager, checkpoint):
    for argv in ([str(checkpoint)], ["--model", str(checkpoint)], ["--model-path", str(checkpoint)]):
        assert validate(_parse(*argv), manager)["model"] == str(checkpoint)
    assert validate(_parse(str(checkpoint), "--model", str(checkpoint)), manager)["model"] == str(checkpoint)
    with pytest.raises(InvalidArgumentError, match="disagree"):
        validate(_parse(str(checkpoint), "--model", "/elsewhere"), manager)
    assert validate(_parse(), manager)["model"] is None


def test_cuda_graph_flags_reach_the_host_settings(manager):
    """SGLang's --cuda-graph-max-bs / --disable-cuda-graph become the host's graph settings (the
    default leaves graphs to the device: on for CUDA)."""
    from kvplug_transformers.serve_options import ServeOptions

    for argv, expected in (((), (None, None)), (("--cuda-graph-max-bs", "32"), (None, 32)),
                           (("--disable-cuda-graph",), (False, None))):
        options = validate(_parse(*argv), manager)
        settings = ServeOptions(**options).kvplug_settings()
        assert (settings["cuda_graphs"], settings["cuda_graph_max_bs"]) == expected


def test_overlap_and_compile_flags_reach_the_host_settings(manager):
    """SGLang's --disable-overlap-schedule / --enable-torch-compile become the host's settings
    (defaults: overlap left to the device, on for CUDA; no compile)."""
    from kvplug_transformers.serve_options import ServeOptions
    from kvplug_transformers.settings import KVPlugSettings

    for argv, expected in (((), (None, False)), (("--disable-overlap-schedule",), (False, False)),
                           (("--enable-torch-compile",), (None, True))):
        settings = ServeOptions(**validate(_parse(*argv), manager)).kvplug_settings()
        assert (settings["overlap_schedule"], settings["torch_compile"]) == expected
        KVPlugSettings().updated(**settings)  # valid host settings


def test_vllm_and_sglang_aliases(manager):
    options = validate(
        _parse("--max-model-len", "512", "--gpu-memory-utilization", "0.3", "--api-key", "k", "--served-model-name",
               "my-model", "--host", "127.0.0.1", "--port", "9001", "--dtype", "half"),
        manager,
    )
    assert options["max_seq_len"] == 512 and options["kv_memory"] == 0.3 and options["api_key"] == "k"
    assert options["served_model_name"] == "my-model" and options["port"] == 9001 and options["dtype"] == "float16"
    assert validate(_parse("--context-length", "300"), manager)["max_seq_len"] == 300
    with pytest.raises(InvalidArgumentError, match="--kv-memory or --gpu-memory-utilization, not both"):
        validate(_parse("--kv-memory", "1GiB", "--gpu-memory-utilization", "0.5"), manager)
    with pytest.raises(InvalidArgumentError, match="--gpu-memory-utilization must be a fraction in \\(0, 1\\]"):
        validate(_parse("--gpu-memory-utilization", "1.5"), manager)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--page-size", "0"], "--page-size must be an int >= 1, got 0"),
        (["--max-running-reqs", "0"], "--max-running-reqs must be an int >= 1, got 0"),
        (["--port", "70000"], "--port must be an int in [1, 65535], got 70000"),
        (["--max-seq-len", "1"], "--max-seq-len must be an int >= 2, got 1"),
        (["--max-batch-tokens", "0"], "--max-batch-tokens must be an int >= 1, got 0"),
        (["--stats-interval", "-1"], "--stats-interval must be >= 0"),
        (["--dtype", "int3"], "--dtype must be auto, bfloat16, float16 or float32, got 'int3'"),
        (["--kv-memory", "2.0"], "--kv-memory as a fraction must lie in (0, 1]"),
        (["--max-request-bytes", "lots"], "--max-request-bytes must be a size"),
        (["--cuda-graph-max-bs", "0"], "--cuda-graph-max-bs must be an int in [1, 64], got 0"),
        (["--max-running-reqs", "8", "--cuda-graph-max-bs", "16"], "--cuda-graph-max-bs must be an int in [1, 8]"),
    ],
)
def test_every_bad_combination_names_the_flag_and_the_rule(manager, argv, message):
    with pytest.raises(KVPlugError) as refused:
        validate(_parse(*argv), manager)
    assert message in str(refused.value)


def test_vllm_and_sglang_spellings_of_kvplug_flags(manager, checkpoint):
    """Issue 29 item 4: each alias sets what its kvplug flag sets; two spellings that disagree are an error."""
    for argv, key, value in (
        (["--max-num-seqs", "8"], "max_running_reqs", 8), (["--max-running-requests", "6"], "max_running_reqs", 6),
        (["--max-num-batched-tokens", "512"], "max_batch_tokens", 512), (["--block-size", "32"], "page_size", 32),
        (["--mem-fraction-static", "0.4"], "kv_memory", 0.4), (["--disable-radix-cache"], "prefix_cache", "naive"),
        (["--enable-prefix-caching"], "prefix_cache", "radix"), (["--no-enable-prefix-caching"], "prefix_cache", "naive"),
        (["--trust-remote-code"], "trust_remote_code", True), (["--seed", "7"], "seed", 7),
        (["--disable-log-requests"], "log_requests", False), (["--uvicorn-log-level", "warning"], "uvicorn_log_level",
                                                               "warning"),
        (["--tp", "1", "--kv-cache-dtype", "auto"], "max_running_reqs", 64),
        (["--max-num-seqs", "8", "--max-running-reqs", "8"], "max_running_reqs", 8),
        ([str(checkpoint), "--tokenizer", str(checkpoint)], "model", str(checkpoint)),
    ):
        assert validate(_parse(*argv), manager)[key] == value, argv
    defaults = validate(_parse(), manager)
    assert (defaults["trust_remote_code"], defaults["seed"], defaults["log_requests"]) == (False, None, True)


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-num-seqs", "8", "--max-running-reqs", "4"],
     "--max-num-seqs 8 (vLLM's name for --max-running-reqs) and --max-running-reqs 4 disagree"),
    (["--block-size", "8", "--page-size", "16"], "--block-size 8 (vLLM's name for --page-size) and --page-size 16"),
    (["--disable-radix-cache", "--prefix-cache", "radix"], "--disable-radix-cache means --prefix-cache naive"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: kvplug serve runs the model on one device"),
    (["--tp", "4"], "--tensor-parallel-size 4"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype 'fp8': kvplug's KV pool stores K/V in the model's dtype"),
    (["--chat-template", "t.jinja"], "--chat-template: kvplug serve uses the checkpoint's chat template"),
    (["--tokenizer", "/elsewhere"], "--tokenizer '/elsewhere': kvplug serve uses the tokenizer next to"),
    (["--mem-fraction-static", "0.5", "--kv-memory", "1GiB"], "give --kv-memory or --gpu-memory-utilization"),
])
def test_an_alias_that_cannot_apply_is_refused_with_the_reason(manager, argv, message):
    with pytest.raises(InvalidArgumentError) as refused:
        validate(_parse(*argv), manager)
    assert message in str(refused.value)


def test_help_has_the_alias_table_one_line_each():
    from kvplug.cli.serve import ALIAS_NOTES, VALUE_ALIASES, aliases_help

    lines = aliases_help().splitlines()
    assert len(lines) == 1 + len(VALUE_ALIASES) + len(ALIAS_NOTES)
    for flag in ("--max-num-seqs", "--max-running-requests", "--max-num-batched-tokens", "--block-size",
                 "--mem-fraction-static", "--disable-radix-cache", "--enable-prefix-caching", "--tokenizer",
                 "--trust-remote-code", "--chat-template", "--seed", "--kv-cache-dtype", "--disable-log-requests",
                 "--uvicorn-log-level", "--tensor-parallel-size"):
        assert sum(1 for line in lines if line.strip().startswith(flag)) == 1, flag


@pytest.mark.parametrize(
    ("argv", "note", "dropped"),
    [
        (["--kv-backend", "native", "--prefix-cache", "naive"], "--prefix-cache configures kvplug's cache: ignored", {}),
        (["--kv-backend", "native", "--attention", "torch", "--max-running-reqs", "4"],
         "--attention, --max-running-reqs configure kvplug's cache: ignored with --kv-backend native", {}),
        (["--kv-backend", "native", "--stats-interval", "1"], "--stats-interval configures", {}),
        (["--kv-backend", "native", "--disable-cuda-graph", "--disable-overlap-schedule", "--enable-torch-compile"],
         "--disable-cuda-graph, --disable-overlap-schedule, --enable-torch-compile configure", {}),
        (["--cuda-graph-max-bs", "8", "--disable-cuda-graph"], "--cuda-graph-max-bs sizes kvplug's CUDA graphs: ignored "
         "with --disable-cuda-graph", {"cuda_graph_max_bs": None}),
        (["--enable-torch-compile", "--disable-cuda-graph"], "--enable-torch-compile compiles the model kvplug captures "
         "in its CUDA graphs: ignored", {"torch_compile": False}),
    ],
)
def test_a_flag_with_no_effect_is_accepted_and_named_never_refused(manager, argv, note, dropped):
    """One rule for flags that do nothing (issue 29 item 8): accepted, dropped, named in a start-up
    warning, so one command line serves both sides of an A/B."""
    from kvplug_transformers.serve_options import ServeOptions
    from kvplug_transformers.settings import KVPlugSettings

    options = validate(_parse(*argv), manager)
    assert len(options["ignored_flags"]) == 1 and note in options["ignored_flags"][0], options["ignored_flags"]
    assert {key: options[key] for key in dropped} == dropped
    serve_options = ServeOptions(**options)
    KVPlugSettings().updated(**serve_options.kvplug_settings())  # what remains is valid host settings
    assert serve_options.no_effect_on(torch.device("cuda")) == options["ignored_flags"]


def test_cuda_only_flags_on_the_cpu_are_named_as_ignored(manager):
    from kvplug_transformers.serve_options import ServeOptions

    options = ServeOptions(**validate(_parse("--cuda-graph-max-bs", "8", "--enable-torch-compile"), manager))
    assert options.no_effect_on(torch.device("cuda")) == ()
    assert options.no_effect_on(torch.device("cpu")) == (
        "--cuda-graph-max-bs, --enable-torch-compile: CUDA only (graphs, compile and overlap), ignored on cpu",)
    assert ServeOptions(**validate(_parse(), manager)).no_effect_on(torch.device("cpu")) == ()


def test_bad_flag_shows_the_serve_usage():
    result = subprocess.run(
        [sys.executable, "-m", "kvplug", "serve", "--speculative-model=draft"],
        capture_output=True, text=True, timeout=60, env=kvplug_env(__import__("pathlib").Path("/nonexistent")),
    )
    assert result.returncode == 2
    assert "usage: kvplug serve" in result.stderr
    assert "unrecognized arguments: --speculative-model=draft" in result.stderr


def test_help_lists_the_registered_components_one_line_each():
    result = subprocess.run(
        [sys.executable, "-m", "kvplug", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    for name in ("naive", "radix", "auto", "torch", "triton", "flashinfer", "fa3"):
        assert sum(1 for line in lines if line.startswith(f"  {name} ")) == 1, name
    naive = next(line for line in lines if line.startswith("  naive "))
    assert "caches nothing" in naive
    # what auto picks is what kvplug.attention.auto picks; fa3 is sgl-kernel's (issue 29 item 6)
    from kvplug.attention.auto import choose_backend_name

    auto = next(line for line in lines if line.startswith("  auto "))
    assert "fa3" not in auto.split("(never")[0] and auto.index("flashinfer") < auto.index("triton")
    config = type("Config", (), {"pool": type("Pool", (), {"device": torch.device("cuda")})})()
    assert choose_backend_name(config, importable=lambda module: True) == "flashinfer"
    assert choose_backend_name(config, importable=lambda module: module == "triton") == "triton"
    fa3 = next(line for line in lines if line.startswith("  fa3 "))
    assert "sgl-kernel" in fa3 and "flash-attn" not in fa3
    for flag in ("--max-model-len", "--model-path", "--gpu-memory-utilization", "--api-key", "--served-model-name",
                 "--shutdown-timeout", "MODEL"):
        assert flag in result.stdout
    assert "vLLM / SGLang flags (one line each):" in result.stdout and "  --max-num-seqs " in result.stdout


def test_busy_port_is_refused_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(KVPlugError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "kvplug", "serve", "--port", str(port)],
            capture_output=True, text=True, timeout=60, env=kvplug_env(tmp_path / "never-built"),
        )
    assert result.returncode == 2 and "already in use" in result.stderr
    assert "embedded" not in result.stderr and not (tmp_path / "never-built").exists()  # nothing loaded or built
    assert time.monotonic() - started < 30
    check_port_free("127.0.0.1", port)  # free again


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from kvplug_transformers.embedded_model import ensure_embedded_model

    directory = tmp_path_factory.mktemp("kvplug-cache")
    ensure_embedded_model(directory)
    return directory


def test_max_seq_len_is_checked_against_the_model_context(cache_dir, tmp_path):
    log = tmp_path / "serve.log"
    process = start(["-m", "kvplug", "serve", "--port", str(free_port()), "--max-model-len", "100000"], cache_dir, log)
    assert process.wait(timeout=120) == 2
    output = log.read_text()
    assert "--max-seq-len (--max-model-len) 100,000 exceeds the model's context of 4,096 tokens" in output
    assert "Traceback" not in output


def test_served_model_name_log_format_and_level(cache_dir, tmp_path):
    import openai

    port, log = free_port(), tmp_path / "serve.log"
    process = start(
        ["-m", "kvplug", "serve", "--port", str(port), "--served-model-name", "tiny", "--kv-memory", "4MiB",
         "--max-seq-len", "256", "--log-level", "warning", "--cuda-graph-max-bs", "4"],
        cache_dir, log,
    )
    try:
        wait_ready(process, port, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [model.id for model in client.models.list().data] == ["tiny"]
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.model == "tiny"
        assert get_json(port, "/kvplug/stats")[1]["model"] == "tiny"
    finally:
        code, _ = stop(process)
    assert code == 0
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    # --log-level warning: no INFO line from any logger (uvicorn's access and startup lines included)
    assert not [line for line in lines if " INFO " in line or line.startswith("INFO:")], lines
    assert all(" WARNING " in line or " ERROR " in line for line in lines), lines
    # the address is shown whatever the level, and a CUDA-only flag on the CPU is named as ignored (issue 29)
    assert any(f"listening on http://127.0.0.1:{port}/v1" in line for line in lines), lines
    assert any("--cuda-graph-max-bs: CUDA only (graphs, compile and overlap), ignored on cpu" in line
               for line in lines), lines


def test_info_log_has_one_format_and_one_pool_line(cache_dir, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    process = start(
        ["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "0.05", "--max-running-reqs", "4",
         "--max-seq-len", "512"],
        cache_dir, log,
    )
    try:
        wait_ready(process, port, log)
    finally:
        code, _ = stop(process)
    assert code == 0
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    import re

    pattern = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) [\w.]+: ")
    assert all(pattern.match(line) for line in lines), [line for line in lines if not pattern.match(line)]
    pool = [line for line in lines if "kvplug KV pool:" in line]
    assert len(pool) == 1
    assert "bytes" in pool[0] and "pages x 16 tokens" in pool[0] and "sized by kv_memory fraction 0.05" in pool[0]
    assert "capped at max_running_reqs x max_seq_len = 4 x 512 tokens" in pool[0]
    assert not any("2 pages x 16 tokens" in line or "Using cuda graphs" in line for line in lines)
    assert not any("Qwen3Config" in line for line in lines)  # the config is printed at debug level only


def test_a_filtered_out_host_plugin_is_not_called_missing(monkeypatch):
    pytest.importorskip("kvplug_transformers")
    from kvplug.cli.serve import find_host

    monkeypatch.setenv("KVPLUG_LOAD_PLUGINS", "")
    with pytest.raises(KVPlugError, match="installed but not loaded: KVPLUG_LOAD_PLUGINS='' does not name it"):
        find_host(PluginManager())
    monkeypatch.delenv("KVPLUG_LOAD_PLUGINS")
    monkeypatch.setenv("KVPLUG_DISABLE_PLUGINS", "transformers")
    with pytest.raises(KVPlugError, match="KVPLUG_DISABLE_PLUGINS='transformers' names it"):
        find_host(PluginManager())


def test_default_served_name_is_the_checkpoint_folder_or_kvplug_default():
    pytest.importorskip("kvplug_transformers")
    from kvplug_transformers.serve_options import ServeOptions

    assert ServeOptions(model="/models/Qwen3-0.6B").model_name("/models/Qwen3-0.6B") == "Qwen3-0.6B"
    assert ServeOptions(model="/models/Qwen3-0.6B/").model_name("/models/Qwen3-0.6B/") == "Qwen3-0.6B"
    assert ServeOptions().model_name("/cache/embedded-default-abc") == "kvplug-default"
    assert ServeOptions(served_model_name="mine").model_name("/models/x") == "mine"
    for bad in ({"shutdown_timeout": 0}, {"max_request_bytes": 10}, {"served_model_name": " "}, {"api_key": ""}):
        with pytest.raises(InvalidArgumentError):
            ServeOptions(**bad)


def test_a_vllm_command_line_serves(cache_dir, tmp_path):
    """A vLLM-style command line starts and serves; --disable-log-requests drops transformers' request
    line and --uvicorn-log-level warning uvicorn's info lines, while kvplug's own stay (issue 29 item 4)."""
    from kvplug_transformers.embedded_model import ensure_embedded_model

    model = ensure_embedded_model(cache_dir)
    port, log = free_port(), tmp_path / "serve.log"
    process = start(
        ["-m", "kvplug", "serve", "--model", str(model), "--tokenizer", str(model), "--port", str(port),
         "--max-num-seqs", "4", "--max-num-batched-tokens", "512", "--block-size", "16", "--max-model-len", "256",
         "--kv-memory", "4MiB", "--enable-prefix-caching", "--trust-remote-code", "--seed", "0", "--tp", "1",
         "--kv-cache-dtype", "auto", "--disable-log-requests", "--uvicorn-log-level", "warning"],
        cache_dir, log,
    )
    try:
        wait_ready(process, port, log)
        import json as json_module

        from tests.serve_process import post

        status, reply = post(port, "/v1/completions", json_module.dumps({"prompt": "hi", "max_tokens": 2}).encode())
        assert status == 200, reply
    finally:
        code, _ = stop(process)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "[Request received]" not in text and "uvicorn.error: Uvicorn running on" not in text, text[-3000:]
    assert "kvplug serve: listening on" in text and "kvplug KV pool: 1,008 tokens = 63 pages x 16 tokens" in text
