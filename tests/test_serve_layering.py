"""The HTTP layer of ``kvplug serve`` stands apart from the transformers integration (issue 25
item 4): serving changes no attribute of uvicorn or transformers' serving modules, and no
integration module imports an HTTP module."""

from __future__ import annotations

import ast
import json
import urllib.request
from pathlib import Path

import pytest

from tests.serve_process import free_port

PACKAGE = Path(__file__).resolve().parents[1] / "adapters" / "transformers" / "kvplug_transformers"
HTTP_MODULES = {
    "server", "http_server", "http_guards", "http_protocol", "generation_routes", "handler_guards", "request_bodies",
    "request_json", "request_limits", "stats_routes", "worker_watch", "prompt_tokens", "log_limits", "serve_options",
    "token_routes", "token_id_prompts", "serve_metrics", "model_checks", "request_sampling", "sampling_fields",
}
INTEGRATION_MODULES = {"installation", "paged_cache", "step_tracker", "attention", "compat", "settings", "host_stats",
                       "planning", "decode_graphs", "plugin", "embedded_model", "sampler", "sampling_params",
                       "stop_strings"}


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvplug_transformers."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[1] for alias in node.names
                         if alias.name.startswith("kvplug_transformers."))
    return names


@pytest.mark.parametrize("module", sorted(INTEGRATION_MODULES))
def test_integration_modules_import_no_http_module(module):
    path = PACKAGE / f"{module}.py"
    if not path.exists():
        pytest.skip(f"{module}.py is not in this tree")
    assert not _imported(path) & HTTP_MODULES


def _snapshot(*objects) -> dict:
    """Every attribute of ``objects`` but submodules (importing one adds it to its package)."""
    import types

    return {
        (id(obj), name): value for obj in objects for name, value in vars(obj).items()
        if not isinstance(value, types.ModuleType)
    }


def test_serving_patches_nothing_in_uvicorn_or_transformers(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import transformers.cli.serving.server as serving_server
    import transformers.cli.serving.utils as serving_utils
    import uvicorn.config
    import uvicorn.server
    from uvicorn.protocols.http import h11_impl

    from kvplug_transformers.embedded_model import ensure_embedded_model
    from kvplug_transformers.host import TransformersHost
    from kvplug_transformers.http_guards import InFlightRequests
    from kvplug_transformers.http_protocol import ConnectionLimits
    from kvplug_transformers.http_server import HttpServer
    from kvplug_transformers.request_limits import RequestLimits
    from kvplug_transformers.serve_options import ServeOptions
    from kvplug_transformers.stats_routes import served_model

    modules = (uvicorn, uvicorn.config, uvicorn.server, h11_impl, h11_impl.H11Protocol, serving_server, serving_utils)
    before = _snapshot(*modules)
    model = ensure_embedded_model(tmp_path)
    port = free_port()
    opts = ServeOptions(model=str(model), kv_backend="native", device="cpu", port=port, log_level="warning")
    inflight = InFlightRequests()
    server = HttpServer(
        TransformersHost(), opts, served_model("tiny", str(model)), "cpu", "float32",
        {"cb_block_size": 16, "cb_num_blocks": 64, "cb_max_batch_tokens": 256}, RequestLimits(512, "test"),
        inflight, ConnectionLimits(16, 5.0, 5.0),
    )
    server.start()
    try:
        import time

        deadline = time.monotonic() + 60
        while not server.started:
            assert server.alive() and time.monotonic() < deadline
            time.sleep(0.05)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode(),
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
        assert _snapshot(*modules) == before  # while serving
    finally:
        server.watch.stop_worker(timeout=5)
        server.uvicorn.should_exit = True
        server.thread.join(timeout=10)
        server.model_manager.shutdown()
        server.tokenizer.shutdown()
    assert _snapshot(*modules) == before
