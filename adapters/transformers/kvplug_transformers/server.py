"""``kvplug serve``: transformers' OpenAI-compatible server with kvplug installed.

The server is transformers' own (``transformers.cli.serve.Serve`` with continuous batching),
started in a background thread; this module plans and installs kvplug first, adds
``GET /kvplug/stats``, logs cache statistics, and turns Ctrl-C / SIGTERM into a clean stop (exit
code 0). Every failure it can foresee — bad model, unknown component, a KV budget too small for one
request, a busy port — becomes a ``KVPlugError`` with an explanation instead of a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Any, Iterator

import torch

from kvplug.interface import InvalidArgumentError, KVPlugError
from kvplug.memory.model_shape import parse_dtype

from kvplug_transformers.compat import require_transformers
from kvplug_transformers.embedded_model import ensure_embedded_model
from kvplug_transformers.planning import model_context_len, model_shape, plan_pool
from kvplug_transformers.serve_options import ServeOptions, native_cb_options
from kvplug_transformers.stats_routes import add_stats_routes

logger = logging.getLogger("kvplug.serve")
STARTUP_TIMEOUT_S = 60.0


def serve(adapter: Any, **options: Any) -> int:
    """Run the server until Ctrl-C / SIGTERM; ``options`` are ``ServeOptions`` fields."""
    opts = ServeOptions(**options)
    _configure_logging(opts.log_level)
    require_transformers()
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise KVPlugError(
            "kvplug serve needs fastapi, uvicorn, pydantic and openai: pip install './adapters/transformers[serve]'"
        )
    model_path = opts.model
    if model_path is None:
        model_path = str(ensure_embedded_model())
        logger.info("no --model: serving the embedded default model from %s", model_path)
        logger.warning("the embedded model has random weights: its output text is meaningless")
    device = _resolve_device(opts.device)
    config = _load_config(model_path)
    dtype_name, kv_dtype = _resolve_dtype(opts.dtype, config, device, embedded=opts.model is None)

    cb_options: dict[str, Any] = {}
    if opts.kv_backend == "kvplug":
        settings = adapter.settings.updated(**opts.kvplug_settings())
        plan = plan_pool(settings, model_shape(config, kv_dtype), device, context_len=model_context_len(config))
        logger.info("kvplug KV pool: %s", plan.describe())
        logger.info("kvplug prefix cache %r, attention %r", settings.prefix_cache, settings.attention)
        _check_components(settings, model_shape(config, kv_dtype), device)
        adapter.install(**opts.kvplug_settings())
    else:
        context_len = opts.max_seq_len or model_context_len(config)
        cb_options = native_cb_options(opts, model_shape(config, kv_dtype), context_len)
        logger.info("native transformers paged cache: %s", cb_options or "transformers defaults")
    try:
        return _run_server(adapter, opts, model_path, device, dtype_name, cb_options)
    finally:
        if opts.kv_backend == "kvplug":
            adapter.uninstall()


def _run_server(
    adapter: Any, opts: ServeOptions, model_path: str, device: torch.device, dtype_name: str, cb_options: dict
) -> int:
    from transformers.cli.serve import Serve

    stop = threading.Event()
    with _stop_on_signals(stop), _stats_routes_added(adapter, opts, model_path):
        try:
            server = Serve(
                force_model=model_path,
                continuous_batching=True,
                device=str(device),
                dtype=dtype_name,
                host=opts.host,
                port=opts.port,
                log_level=opts.log_level,
                non_blocking=True,
                **cb_options,
            )
        except KVPlugError:
            raise
        except Exception as error:  # transformers raises many types for a bad checkpoint
            raise KVPlugError(f"cannot load the model from {model_path}: {type(error).__name__}: {error}") from error
        try:
            _wait_until_started(server, opts, stop)
            logger.info(
                "kvplug serve: listening on http://%s:%d/v1 (kv backend %s) for model %r; statistics at /kvplug/stats",
                opts.host, opts.port, opts.kv_backend, model_path,
            )
            _watch(server, adapter, opts, stop)
        finally:
            logger.info("kvplug serve: shutting down")
            _shutdown(server)
    if opts.kv_backend == "kvplug":
        logger.info("%s", adapter.stats().describe())
    logger.info("kvplug serve: stopped")
    return 0


def _check_components(settings: Any, shape: Any, device: torch.device) -> None:
    """Build a two-page backend with the chosen components now: a prefix cache or attention
    backend that cannot run on this device / dtype fails at startup, not at the first request."""
    from kvplug.backend import create_backend

    try:
        create_backend(
            shape, page_size=settings.page_size, num_pages=2, max_running_reqs=1, max_seq_len=settings.page_size,
            prefix_cache=settings.prefix_cache, attention=settings.attention, device=device,
            **dict(settings.backend_options),
        )
    except KVPlugError:
        raise
    except Exception as error:  # e.g. a GPU library missing or refusing this dtype
        raise KVPlugError(
            f"the kvplug components (prefix cache {settings.prefix_cache!r}, attention {settings.attention!r}) "
            f"cannot run on {device} with {shape.dtype}: {type(error).__name__}: {error}"
        ) from error


def _wait_until_started(server: Any, opts: ServeOptions, stop: threading.Event) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.server.started:
        if not server._thread.is_alive():
            raise KVPlugError(f"the HTTP server could not start on {opts.host}:{opts.port} (is the port in use?)")
        if stop.is_set():
            return
        if time.monotonic() > deadline:
            raise KVPlugError(f"the HTTP server did not start within {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _watch(server: Any, adapter: Any, opts: ServeOptions, stop: threading.Event) -> None:
    """Block until a stop signal, logging cache statistics every ``stats_interval`` s when they change."""
    last_logged, last_time = None, time.monotonic()
    while not stop.wait(0.2):
        if not server._thread.is_alive():
            raise KVPlugError("the HTTP server thread exited unexpectedly")
        if opts.kv_backend != "kvplug" or opts.stats_interval <= 0:
            continue
        if time.monotonic() - last_time >= opts.stats_interval:
            stats, last_time = adapter.stats(), time.monotonic()
            if stats != last_logged:
                logger.info("%s", stats.describe())
                last_logged = stats


def _shutdown(server: Any) -> None:
    server.kill_server()  # stops the continuous-batching thread, unloads the model, asks uvicorn to exit
    thread = getattr(server, "_thread", None)
    if thread is not None and thread.is_alive():
        server.server.force_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        logger.info("kvplug serve: received %s", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _stats_routes_added(adapter: Any, opts: ServeOptions, model_path: str) -> Iterator[None]:
    """transformers builds its FastAPI app inside ``Serve``; wrap its ``build_server`` for the
    duration so kvplug's routes are on the app before it starts serving."""
    import transformers.cli.serving.server as server_module

    original = server_module.build_server

    def build_server_with_stats(*args: Any, **kwargs: Any) -> Any:
        generation_state = kwargs.get("generation_state")
        app = original(*args, **kwargs)
        add_stats_routes(app, adapter, opts, model_path, generation_state)
        return app

    server_module.build_server = build_server_with_stats
    try:
        yield
    finally:
        server_module.build_server = original


def _configure_logging(level_name: str) -> None:
    level = logging.getLevelName(level_name.upper())
    if not isinstance(level, int):
        raise InvalidArgumentError(f"--log-level must be debug, info, warning or error, got {level_name!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("kvplug", "kvplug_transformers"):
        logging.getLogger(name).setLevel(level)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InvalidArgumentError(
            f"--device must name a torch device (auto, cpu, cuda, cuda:1), got {device!r}"
        ) from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"--device {device} asked for CUDA, which is not available here")
    return resolved


def _load_config(model_path: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path)
    except Exception as error:  # ValueError, OSError, KeyError (unknown model_type), JSON errors
        raise InvalidArgumentError(
            f"cannot read the model config in {model_path}: {type(error).__name__}: {error}"
        ) from error


def _resolve_dtype(dtype: str, config: Any, device: torch.device, *, embedded: bool) -> tuple[str, torch.dtype]:
    """(the name transformers gets, the KV dtype kvplug plans with)."""
    if dtype == "auto":
        if embedded and device.type == "cuda":
            return "bfloat16", torch.bfloat16  # the embedded checkpoint is fp32; GPU kernels want 16-bit
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        config_dtype = getattr(text_config, "dtype", None) or getattr(config, "dtype", None)
        return "auto", parse_dtype(str(config_dtype)) if config_dtype is not None else torch.float32
    kv_dtype = parse_dtype(dtype)
    return str(kv_dtype).removeprefix("torch."), kv_dtype
