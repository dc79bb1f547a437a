"""``kvplug serve``: transformers' OpenAI-compatible server with kvplug installed.

The handlers and the FastAPI app are transformers' own (continuous batching), built and served by
``HttpServer`` in a background thread on a uvicorn server configured for it (no process-wide
patch of uvicorn or transformers); this module plans and installs kvplug first. The HTTP layer
(``http_*``, ``generation_routes``, ``handler_guards``, ``request_*``, ``stats_routes``) imports
the integration, never the reverse:

* every request gets the server's own id (a client's ``X-Request-ID`` is only echoed); its body
  is parsed and checked off the event loop (4xx naming the field), and so is tokenising: no
  request holds up another route;
* the model may be named by ``--served-model-name`` or omitted, unsupported parameters (``n > 1``
  ...) are refused; with the kvplug cache every request samples with its own settings and stop
  strings (``request_sampling``, ``sampler``, ``stop_strings``), with transformers' own cache sampling other than the
  model's ``generation_config.json`` is refused (it applies one setting to every request);
  client chat templates only with ``--trust-request-chat-template``;
* a prompt that cannot fit is refused with a 400 naming the limit, ``max_tokens`` is lowered to the
  room left (``finish_reason: "length"``), bodies over ``--max-request-bytes`` get 413: no request
  can stop the batching worker;
* connections: read deadlines for heads and bodies (408), a connection cap (the longest-idle one
  makes room, else 503), streams nobody reads are cut off with their rows freed, and no condition
  can flood the log;
* the worker is watched: if it dies anyway, running requests get a 503, ``/health`` and
  ``/kvplug/stats`` say so and the process exits with an error;
* SIGTERM / Ctrl-C: new requests are refused at once, running ones may finish, what still runs
  at ``--shutdown-timeout`` minus a margin is aborted, and the process exits 0 within the timeout.
* ``--engine-process``: the model, the batching worker and kvplug run in a process of their own
  (``engine_process``, ``engine_client``); this process keeps HTTP and detokenising, and the engine
  process's death is the worker's.
* ``--api-server-count N``: N such HTTP processes share the listening socket over one engine
  process (``api_servers``); this one starts and watches the others.

Every failure it can foresee at startup (bad model, unknown component, a KV budget too small for one
request, a busy port, a ``--max-seq-len`` beyond the model's context) is a ``KVPlugError`` with an
explanation instead of a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

import torch

from kvplug.interface import InvalidArgumentError, KVPlugError
from kvplug.memory.model_shape import parse_dtype

from kvplug_transformers.api_servers import ApiServerRole, ApiServers
from kvplug_transformers.compat import require_transformers
from kvplug_transformers.embedded_model import ensure_embedded_model
from kvplug_transformers.exit_deadline import ExitDeadline, teardown_reserve
from kvplug_transformers.http_guards import InFlightRequests
from kvplug_transformers.http_protocol import ConnectionLimits
from kvplug_transformers.http_server import HttpServer
from kvplug_transformers.log_limits import RateLimitedLog
from kvplug_transformers.model_checks import check_model_config
from kvplug_transformers.planning import PoolPlan, model_context_len, model_shape, plan_pool
from kvplug_transformers.request_limits import RequestLimits
from kvplug_transformers.serve_options import ACCEPT_BACKLOG, ServeOptions, native_cb_options
from kvplug_transformers.stats_routes import ServedModel, served_model
from kvplug_transformers.worker_watch import WorkerWatch

logger = logging.getLogger("kvplug.serve")
STARTUP_TIMEOUT_S = 60.0
WORKER_DEATH_GRACE_S = 1.0  # time for aborted requests to get their 503 before the process exits
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
IDLE_POOL_THREAD = "AnyIO worker thread"  # Starlette runs sync routes there; idle ones never exit by themselves
CB_LOGGER = "ContinuousBatchingLogger"  # transformers' continuous batching logs here
OTHER_API_SERVERS_EARLIER_SHARE = 0.1  # of --shutdown-timeout, at most OTHER_API_SERVERS_EARLIER_MAX_S: the
OTHER_API_SERVERS_EARLIER_MAX_S = 1.0  # other API servers abort what still runs that much before the engine stops


def serve(adapter: Any, *, api_server: ApiServerRole | None = None, **options: Any) -> int:
    """Run the server until Ctrl-C / SIGTERM; ``options`` are ``ServeOptions`` fields;
    ``api_server``: this process is one of ``--api-server-count``'s others (``api_servers``)."""
    opts = ServeOptions(**options)
    _configure_logging(opts.log_level, opts.uvicorn_log_level, log_requests=opts.log_requests)
    require_transformers()
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise KVPlugError(
            "kvplug serve needs fastapi, uvicorn, pydantic and openai: pip install './adapters/transformers[serve]'"
        )
    require_transformers(serving=True)  # the server's own internals import its [serve] extras
    model_path = opts.model
    if model_path is None:
        model_path = str(ensure_embedded_model())
        logger.info("no MODEL given: serving the embedded default model from %s", model_path)
        logger.warning("the embedded model has random weights: its output text is meaningless")
    device = _resolve_device(opts.device)
    for note in opts.no_effect_on(device):
        logger.warning("kvplug serve: %s", note)
    config = _load_config(model_path, trust_remote_code=opts.trust_remote_code)
    if opts.seed is not None:
        torch.manual_seed(opts.seed)  # vLLM's --seed: what samples, samples the same way every run
    logger.debug("model config: %s", json.dumps(config.to_dict(), sort_keys=True, default=str))
    context_len = model_context_len(config)
    if opts.max_seq_len is not None and opts.max_seq_len > context_len:
        raise InvalidArgumentError(
            f"--max-seq-len (--max-model-len) {opts.max_seq_len:,} exceeds the model's context of "
            f"{context_len:,} tokens (max_position_embeddings in {model_path}/config.json); "
            f"give at most {context_len:,}"
        )
    dtype_name, kv_dtype = _resolve_dtype(opts.dtype, config, device, embedded=opts.model is None)
    check_model_config(config, model_path, opts.kv_backend, kv_dtype)
    shape = model_shape(config, kv_dtype)

    cb_options: dict[str, Any] = {}
    engine_settings = None
    if opts.kv_backend == "kvplug":
        settings = adapter.settings.updated(**opts.kvplug_settings())
        plan = plan_pool(settings, shape, device, context_len=context_len)
        logger.info("kvplug KV pool: %s", describe_pool(plan))
        if opts.host_memory:
            logger.info(
                "kvplug host-memory tier: %s bytes (%.1f MiB) under the %s cache, about %s tokens",
                f"{opts.host_memory:,}", opts.host_memory / (1 << 20), settings.prefix_cache, f"{opts.host_memory // shape.kv_bytes_per_token():,}",
            )
        if opts.remote_kv:  # issue 30; never the password
            from kvplug.interface.kv_store import redact_url

            logger.info("kvplug remote KV store under the host tier: %s", redact_url(opts.remote_kv))
        logger.info("kvplug prefix cache %r, attention %r", settings.prefix_cache, settings.attention)
        if api_server is None:  # the first API server checked them (and the engine builds them)
            _check_components(settings, shape, device)
        limits = RequestLimits(min(plan.max_seq_len, plan.num_tokens), _limit_source(opts, context_len))
        if opts.engine_process:
            engine_settings = settings  # installed in the engine process, not here
        else:
            adapter.install(**opts.kvplug_settings())
    else:
        max_seq_len = opts.max_seq_len or context_len
        cb_options = native_cb_options(opts, shape, max_seq_len)
        pool_tokens = cb_options.get("cb_num_blocks", 0) * opts.page_size or max_seq_len
        limits = RequestLimits(min(max_seq_len, pool_tokens), _limit_source(opts, context_len))
        logger.info("native transformers paged cache: %s", cb_options or "transformers defaults")
    served = served_model(opts.model_name(model_path), model_path)
    publisher = None
    exit_deadline = ExitDeadline()  # armed when the stop begins: the process is gone by --shutdown-timeout
    try:
        try:
            publisher = _start_kv_events(adapter, opts)  # binds now: an address in use fails the start
            death, threads_left = _run_server(adapter, opts, served, device, dtype_name, cb_options, limits,
                                              engine_settings, exit_deadline, api_server)
        finally:
            if opts.kv_backend == "kvplug":
                adapter.uninstall()
            else:
                from kvplug_transformers.native_installation import uninstall_native_sampler

                uninstall_native_sampler()  # installed when the worker started (native_sampling)
            if publisher is not None:
                adapter.publish_kv_events(None)
                publisher.close()
        return _finish(death, threads_left)
    finally:
        exit_deadline.disarm()


def _finish(death: str | None, threads_left: list[str]) -> int:
    """The exit code once stopped (or ``os._exit`` when threads would hold the process)."""
    failure = None if death is None else KVPlugError(f"the batching worker died ({death}); the server stopped")
    if threads_left:
        # a non-daemon thread would hold the process: anyio's idle thread-pool workers, or a
        # transformers thread stuck in a long forward. The bounded stop is the promise: leave
        # without waiting for them
        stuck = [name for name in threads_left if not name.startswith(IDLE_POOL_THREAD)]
        if stuck:
            logger.warning("kvplug serve: exiting with %s still running", ", ".join(stuck))
        logging.shutdown()
        if failure is not None:
            print(f"kvplug serve: error: {failure}", file=sys.stderr)  # what the CLI prints for an error
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if failure is None else 2)
    if failure is not None:
        raise failure
    return 0


def describe_pool(plan: PoolPlan) -> str:
    """The pool line: tokens, pages, bytes, what sized it, and whether rows x max_seq_len capped it."""
    text = plan.describe()
    useful_pages = -(-plan.max_running_reqs * plan.max_seq_len // plan.page_size)
    if plan.num_pages == useful_pages:
        text += (
            f"; capped at max_running_reqs x max_seq_len = {plan.max_running_reqs} x {plan.max_seq_len:,} tokens "
            "(more could never be used: raise --max-running-reqs for more)"
        )
    return text


def _limit_source(opts: ServeOptions, context_len: int) -> str:
    if opts.max_seq_len is not None:
        return f"--max-seq-len {opts.max_seq_len}"
    return f"the model's context, max_position_embeddings {context_len}"


def _run_server(
    adapter: Any, opts: ServeOptions, served: ServedModel, device: torch.device, dtype_name: str, cb_options: dict,
    limits: RequestLimits, engine_settings: Any = None, exit_deadline: ExitDeadline | None = None,
    api_server: ApiServerRole | None = None,
) -> tuple[str | None, list[str]]:
    """Serve until a stop signal or the worker's death; returns (why the worker died or ``None``,
    non-daemon threads still alive). ``exit_deadline`` is armed at the stop's start."""
    stop = StopRequest()
    inflight = InFlightRequests(stall_timeout=opts.stream_stall_timeout)
    connections = ConnectionLimits(opts.connection_limit(), opts.timeout_header, opts.timeout_body,
                                   opts.stream_stall_timeout)
    with _stop_on_signals(stop):
        others = None  # --api-server-count N: API servers 1 .. N - 1, started and watched here
        if api_server is None and opts.api_server_count > 1:
            others = ApiServers(opts.api_server_count, opts.host, opts.port, ACCEPT_BACKLOG)
            api_server = others.own
            others.start(adapter.settings, _other_options(opts))
        try:
            server = HttpServer(adapter, opts, served, device, dtype_name, cb_options, limits, inflight, connections,
                                kvplug_settings=engine_settings, api_server=api_server)
        except BaseException as error:
            if others is not None:
                others.join(time.monotonic())  # killed: none serves without this one
            if isinstance(error, KVPlugError) or not isinstance(error, Exception):
                raise
            # transformers raises many types for a bad checkpoint
            raise KVPlugError(f"cannot load the model from {served.path}: {type(error).__name__}: {error}") from error
        if not _is_loopback(opts.host) and not opts.api_key:
            logger.warning(
                "kvplug serve: listening on %s without --api-key: anyone who can reach this address can use the "
                "server", opts.host,
            )
        server.start()
        watch = server.watch
        death = None
        try:
            _wait_until_started(server, opts, stop)
            # the pool is built and the worker started now, not at the first request: what cannot be
            # built fails the start, and /health says "starting" (503) until then
            logger.info("kvplug serve: building the KV cache and starting the batching worker (/health answers "
                        "503 starting until then)")
            built_at = time.monotonic()
            if api_server is not None and api_server.index > 0:
                if server.start_worker(stop):
                    api_server.ready.set()
                    logger.info("kvplug serve: API server %d of %d serving", api_server.index, api_server.count)
                    death = _watch(server, server.stats_source, opts, stop, watch)
            elif server.start_worker(stop, others):
                logger.info("kvplug serve: KV cache built, batching worker running (%.2f s)", time.monotonic() - built_at)
                if others is not None:
                    logger.info("kvplug serve: %d API server processes share the port (this one and pids %s)",
                                opts.api_server_count, ", ".join(map(str, others.pids())))
                # the address is what an operator needs whatever --log-level hides: at least a warning's level
                logger.log(
                    max(logging.INFO, logger.getEffectiveLevel()),
                    "kvplug serve: listening on http://%s:%d/v1 (kv backend %s), model %r (%s), up to %d tokens per "
                    "request, %d connections; statistics at /kvplug/stats",
                    opts.host, opts.port, opts.kv_backend, served.name, served.path, limits.max_context_len,
                    connections.max_connections,
                )
                death = _watch(server, server.stats_source, opts, stop, watch, others)
        finally:
            deadline = stop.deadline(opts.shutdown_timeout)
            if exit_deadline is not None:  # what follows is bounded by the timeout, teardown included
                exit_deadline.arm(deadline, 0 if death is None and sys.exc_info()[1] is None else 2)
            threads_left = _shutdown(server, watch, inflight, deadline - teardown_reserve(opts.shutdown_timeout),
                                     others)
    if opts.kv_backend == "kvplug" and (api_server is None or api_server.index == 0):
        logger.info("%s", server.stats_source.stats().describe())
    if death is None:
        logger.info("kvplug serve: stopped")
    return death, threads_left


def _other_options(opts: ServeOptions) -> dict:
    """What API servers 1 .. N - 1 run ``serve`` with: these options, a shorter stop (what they
    still run is aborted before this process stops the engine)."""
    options = {field.name: getattr(opts, field.name) for field in dataclasses.fields(opts)}
    earlier = min(OTHER_API_SERVERS_EARLIER_MAX_S, opts.shutdown_timeout * OTHER_API_SERVERS_EARLIER_SHARE)
    options["shutdown_timeout"] = opts.shutdown_timeout - earlier
    return options


def _start_kv_events(adapter: Any, opts: ServeOptions) -> Any:
    """The KV event publisher of ``--kv-events-config`` (issue 27), its collector given to the
    adapter's caches; ``None`` without one."""
    config = opts.kv_events
    if config is None or not config.enabled or opts.kv_backend != "kvplug":
        return None
    from kvplug.events import KVEventCollector, create_publisher

    publisher = create_publisher(config)
    adapter.publish_kv_events(KVEventCollector(publisher))
    replay = f", replay on {config.replay_endpoint}" if config.replay_endpoint else ""
    logger.info(
        "kvplug serve: publishing KV events on %s (%s, topic %r%s), sequence numbers from %d",
        config.endpoint, "bound" if config.bind else "connected", config.topic, replay, publisher.stats().next_sequence,
    )
    exposed = [endpoint for endpoint in (config.endpoint if config.bind else None, config.replay_endpoint)
               if endpoint is not None and not _is_local_endpoint(endpoint)]
    if exposed:
        logger.warning(
            "kvplug serve: KV events on %s can be read by anyone who reaches that address; they carry the token ids "
            "of every cached prompt", ", ".join(exposed),
        )
    return publisher


def _is_local_endpoint(endpoint: str) -> bool:
    """A ZMQ address only this machine reaches: ipc://, inproc://, or tcp:// on a loopback address."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return _is_loopback(host)


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_components(settings: Any, shape: Any, device: torch.device) -> None:
    """Build a two-page backend with the chosen components now: a prefix cache or attention
    backend that cannot run on this device / dtype fails at startup, not at the first request.
    Its own log lines (a 2-page pool) would only confuse: they are held back."""
    from kvplug.backend import create_backend

    options = dict(settings.backend_options)
    if settings.host_memory is not None:  # a tier of one page: the cache is built as served, its tier attached
        cache_options = dict(options.get("prefix_cache_options") or {})
        cache_options["host_memory"] = settings.page_size * shape.kv_bytes_per_token()
        options["prefix_cache_options"] = cache_options
    quiet = logging.getLogger("kvplug.backend")
    level = quiet.level
    quiet.setLevel(max(logging.WARNING, quiet.getEffectiveLevel()))
    try:
        create_backend(
            shape, page_size=settings.page_size, num_pages=2, max_running_reqs=1, max_seq_len=settings.page_size,
            prefix_cache=settings.prefix_cache, attention=settings.attention, device=device, **options,
        )
    except KVPlugError:
        raise
    except Exception as error:  # e.g. a GPU library missing or refusing this dtype
        raise KVPlugError(
            f"the kvplug components (prefix cache {settings.prefix_cache!r}, attention {settings.attention!r}) "
            f"cannot run on {device} with {shape.dtype}: {type(error).__name__}: {error}"
        ) from error
    finally:
        quiet.setLevel(level)


def _wait_until_started(server: HttpServer, opts: ServeOptions, stop: threading.Event) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not server.alive():
            raise KVPlugError(f"the HTTP server could not start on {opts.host}:{opts.port} (is the port in use?)")
        if stop.is_set():
            return
        if time.monotonic() > deadline:
            raise KVPlugError(f"the HTTP server did not start within {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _watch(server: HttpServer, adapter: Any, opts: ServeOptions, stop: threading.Event, watch: WorkerWatch,
           others: ApiServers | None = None) -> str | None:
    """Block until a stop signal or the worker's death (returned), logging cache statistics every
    ``stats_interval`` s when they change; another API server's exit stops the server."""
    last_logged, last_time = None, time.monotonic()
    while not stop.wait(0.2):
        death = watch.check()
        if death is not None:
            stop.wait(WORKER_DEATH_GRACE_S)
            return death
        if not server.alive():
            raise KVPlugError("the HTTP server thread exited unexpectedly")
        gone = others.dead() if others is not None else None
        if gone is not None:
            raise KVPlugError(f"{gone}; the server stopped")
        if opts.kv_backend != "kvplug" or opts.stats_interval <= 0:
            continue
        if time.monotonic() - last_time >= opts.stats_interval:
            stats, last_time = adapter.stats(), time.monotonic()
            if stats != last_logged:
                logger.info("%s", stats.describe())
                last_logged = stats
    return None


def _shutdown(server: HttpServer, watch: WorkerWatch, inflight: InFlightRequests, deadline: float,
              others: ApiServers | None = None) -> list[str]:
    """Stop by ``deadline`` (``time.monotonic()``; the stop signal plus ``--shutdown-timeout``, less
    the teardown's reserve):
    refuse new requests and close the listener at once, let running requests finish until
    ``deadline - margin`` (the other API servers', stopped too, until they exit), abort the rest
    (the other API servers abort theirs earlier), stop the worker, the other API servers (killed at ``deadline - margin / 4``) and the
    HTTP thread. Returns the names
    of non-daemon threads still alive at the deadline."""
    start = time.monotonic()
    timeout = max(deadline - start, 0.0)
    margin = min(2.0, timeout / 2)
    if others is not None:
        others.signal_stop()  # they stop as this one does, a little sooner
    inflight.close("the server is shutting down")
    uvicorn_server = server.uvicorn
    uvicorn_server.should_exit = True  # uvicorn closes its listening socket at its next tick
    running = inflight.count()
    if running:
        logger.info(
            "kvplug serve: shutting down; waiting up to %.1f s for %d running request(s)", timeout - margin, running
        )
    else:
        logger.info("kvplug serve: shutting down")
    # the other API servers' requests need the engine: it stops once they are gone (or at the bound)
    while (inflight.count() or (others is not None and others.running())) and time.monotonic() < deadline - margin:
        time.sleep(0.05)
    aborted = inflight.abort_all("the server is shutting down: request aborted")
    if aborted:
        logger.warning("kvplug serve: aborted %d request(s) still running at shutdown", aborted)
    if not watch.stop_worker(timeout=max(deadline - time.monotonic() - margin / 2, 0.1)):
        logger.warning("kvplug serve: the batching worker did not stop in time")
    if not server.stop_engine(timeout=max(deadline - time.monotonic() - margin / 2, 0.1)):
        logger.warning("kvplug serve: the engine process did not stop in time; killed")
    if others is not None and not others.join(deadline - margin / 4):
        logger.warning("kvplug serve: another API server did not stop in time; killed")
    thread = server.thread
    if thread is not None:
        thread.join(timeout=max(deadline - time.monotonic() - margin / 4, 0.1))
        if thread.is_alive():
            uvicorn_server.force_exit = True
            thread.join(timeout=max(deadline - time.monotonic(), 0.1))
    with contextlib.suppress(Exception):  # the model is being dropped anyway; never fail the stop on it
        server.model_manager.shutdown()
    server.tokenizer.shutdown()
    logger.debug("kvplug serve: shutdown took %.2f s", time.monotonic() - start)
    return [
        t.name for t in threading.enumerate()
        if t is not threading.main_thread() and t.is_alive() and not t.daemon
    ]


class StopRequest(threading.Event):
    """The server's stop: set by SIGINT / SIGTERM (or the worker's death), with when it was asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked_at: float | None = None

    def request(self) -> None:
        if self.asked_at is None:
            self.asked_at = time.monotonic()
        self.set()

    def deadline(self, timeout: float) -> float:
        """When the process must be gone: ``timeout`` s after the stop was asked for (or from now)."""
        return (self.asked_at if self.asked_at is not None else time.monotonic()) + timeout


@contextlib.contextmanager
def _stop_on_signals(stop: StopRequest) -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            logger.info("kvplug serve: received %s again; already stopping", signal.Signals(signum).name)
            return
        stop.request()  # the time first: the log line may wait for the log's lock
        logger.info("kvplug serve: received %s", signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# (logger name prefix, message prefix) of lines that repeat what another line says, or say per
# request what the server logs at debug level: shown only with --log-level debug
REPEATED_LINES = (
    ("transformers.cli.serving", "[Request received]"),  # a warning per request
    ("transformers.cli.serving", "Loading "),  # the model load, already announced
    ("transformers.tokenization_utils_base", "Token indices sequence length"),  # over-long prompts get a 400
    ("kvplug_transformers", "kvplug installed into transformers"),  # the settings, in the pool line
    ("kvplug.backend", "kvplug backend: "),  # the pool, in "kvplug KV pool built"
    ("kvplug.backend", "attention='auto' on"),  # the attention backend, in "kvplug KV pool built"
)


class _RepeatedLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING:
            return True
        for name, prefix in REPEATED_LINES:
            if record.name.startswith(name) and str(record.msg).startswith(prefix):
                return False
        return True


def _transformers_level(level_name: str) -> str:
    """transformers' info lines are its config dumps and internals: shown from warning up."""
    return "warning" if level_name in ("debug", "info") else level_name


def _configure_logging(level_name: str, uvicorn_level_name: str | None = None, *, log_requests: bool = True) -> None:
    level = logging.getLevelName(level_name.upper())
    if not isinstance(level, int):
        raise InvalidArgumentError(f"--log-level must be debug, info, warning or error, got {level_name!r}")
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RateLimitedLog())  # no client can flood the log
        if level > logging.DEBUG:
            handler.addFilter(_RepeatedLines())
        if not log_requests:
            handler.addFilter(_drop_request_lines)
    logging.captureWarnings(True)
    for name in ("kvplug", "kvplug_transformers"):
        logging.getLogger(name).setLevel(level)
    uvicorn_level = level if uvicorn_level_name is None else _uvicorn_level(uvicorn_level_name)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(uvicorn_level)
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # require_transformers reports it next
        return
    transformers_logging.disable_default_handler()  # its own "[transformers] ..." format
    transformers_logging.enable_propagation()
    transformers_logging.set_verbosity(logging.getLevelName(_transformers_level(level_name).upper()))
    if level > logging.DEBUG:
        transformers_logging.disable_progress_bar()
    import transformers.generation.continuous_batching.requests  # noqa: F401  (creates the logger below)

    batching = logging.getLogger(CB_LOGGER)  # its own handler and format, and per-start info chatter
    for handler in list(batching.handlers):
        batching.removeHandler(handler)
    batching.propagate = True
    batching.setLevel(level if level == logging.DEBUG else max(level, logging.WARNING))


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InvalidArgumentError(
            f"--device must name a torch device (auto, cpu, cuda, cuda:1), got {device!r}"
        ) from error
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"--device must be auto, cpu or a CUDA device (cuda, cuda:1), got {device!r}: kvplug serve runs the model "
            f"there, and {resolved.type!r} holds no data to run it on"
        )
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"--device {device} asked for CUDA, which is not available here")
    return resolved


def _load_config(model_path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
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


REQUEST_LINE = "[Request received]"  # transformers' serving handlers log one per request


def _drop_request_lines(record: logging.LogRecord) -> bool:
    """``--disable-log-requests``: transformers' per-request line is dropped, nothing else."""
    return not str(record.msg).startswith(REQUEST_LINE)


def _uvicorn_level(name: str) -> int:
    return 5 if name == "trace" else logging.getLevelName(name.upper())  # uvicorn's TRACE level is 5
