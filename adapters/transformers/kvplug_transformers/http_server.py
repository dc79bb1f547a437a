"""``HttpServer``: transformers' serving handlers and FastAPI app, with kvplug's guards and routes,
run by a uvicorn server configured for it, in a background thread.

It builds what ``transformers.cli.serve.Serve`` builds (model manager, generation state, the
handlers, ``build_server``'s app) but configures its own ``uvicorn.Config`` and ``uvicorn.Server``
objects: nothing in transformers or uvicorn is replaced, so importing or running kvplug changes
no module-level attribute of either.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from kvplug.interface import KVPlugError

from kvplug_transformers.api_servers import add_api_server_header
from kvplug_transformers.cache_routes import add_cache_routes
from kvplug_transformers.generation_routes import add_generation_routes
from kvplug_transformers.handler_guards import guard_handlers
from kvplug_transformers.http_guards import InFlightRequests, wrap_app
from kvplug_transformers.http_protocol import ConnectionLimits
from kvplug_transformers.prompt_tokens import OffLoopTokenizer
from kvplug_transformers.request_limits import RequestLimits
from kvplug_transformers.serve_metrics import ServeMetrics, add_metrics_route
from kvplug_transformers.serve_options import ACCEPT_BACKLOG
from kvplug_transformers.stats_routes import ServedModel, add_kvplug_routes
from kvplug_transformers.token_routes import add_token_routes
from kvplug_transformers.request_sampling import RequestSampling
from kvplug_transformers.worker_warmup import request_warmup
from kvplug_transformers.worker_watch import WorkerWatch

logger = logging.getLogger("kvplug.serve")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "tiktoken.model")


class HttpServer:
    """Loads the model (in the constructor) and serves it once ``start`` is called.

    Args:
        adapter: the ``TransformersHost`` (for ``/kvplug/stats``).
        opts: the ``ServeOptions``.
        served: the model's name and checkpoint.
        device, dtype_name: for transformers' model manager.
        cb_options: transformers' continuous-batching options (``cb_*``; native backend).
        limits: what one request may hold.
        inflight: the server's running requests.
        connections: the connection cap and read deadlines.
        kvplug_settings: the ``KVPlugSettings`` the engine process installs (``--engine-process``;
            ``None`` with the native backend).
        api_server: with ``--api-server-count`` N > 1, this process's part (``api_servers``): it
            serves the shared socket, and its responses name it.
    """

    def __init__(
        self, adapter: Any, opts: Any, served: ServedModel, device: Any, dtype_name: str, cb_options: dict,
        limits: RequestLimits, inflight: InFlightRequests, connections: ConnectionLimits,
        kvplug_settings: Any = None, api_server: Any = None,
    ) -> None:
        import uvicorn
        from transformers import ContinuousBatchingConfig
        from transformers.cli.serving.chat_completion import ChatCompletionHandler
        from transformers.cli.serving.completion import CompletionHandler
        from transformers.cli.serving.model_manager import ModelManager
        from transformers.cli.serving.response import ResponseHandler
        from transformers.cli.serving.server import build_server
        from transformers.cli.serving.utils import GenerationState

        engine_process = opts.engine_process
        # with --engine-process the weights live in the engine process: here only the config,
        # generation config and tokenizer the handlers read (a model on the meta device)
        self.model_manager = ModelManager(device="meta" if engine_process else str(device), dtype=dtype_name,
                                          force_model=served.path, trust_remote_code=opts.trust_remote_code)
        for timed in self.model_manager.loaded_models.values():
            # the pinned model is never unloaded (force_model), yet every request's model lookup
            # restarts its unload timer: a thread started per request on the event loop
            timed.reset_timer = _pinned
        cb_kwargs = {
            key.removeprefix("cb_"): value for key, value in cb_options.items() if value is not None
        }
        if opts.kv_backend == "native":
            # transformers' per-request temperature / top-k / top-p (the same math as its shared ones):
            # a request kvplug's sampler samples sets them neutral, so its row's logits stay raw
            cb_kwargs["per_request_processors"] = True
        generation_state = GenerationState(
            continuous_batching=True, cb_config=ContinuousBatchingConfig(**cb_kwargs) if cb_kwargs else None
        )
        self.generation_state = generation_state
        self.stats_source = adapter  # what /kvplug/stats, /health, /metrics and the log read HostStats from
        self.ready = threading.Event()  # set once the pool is built and the worker runs: /health says ok
        handlers = {
            "chat": ChatCompletionHandler(model_manager=self.model_manager, generation_state=generation_state),
            "completion": CompletionHandler(model_manager=self.model_manager, generation_state=generation_state),
            "response": ResponseHandler(model_manager=self.model_manager, generation_state=generation_state),
        }
        self._chat = handlers["chat"]
        _, model, processor = handlers["chat"]._resolve_model({})
        # the kvplug cache samples each request its own way; transformers' own applies one config to all.
        # With --engine-process the settings registered here travel with each request to the engine's sampler
        decode = lambda ids: processor.decode(ids, skip_special_tokens=True)  # noqa: E731
        vocab_size = model.config.get_text_config().vocab_size
        if opts.kv_backend == "kvplug":
            self.sampling: RequestSampling = RequestSampling(model.generation_config, vocab_size, decode=decode)
            if not engine_process:
                adapter.sample_per_request(self.sampling)
        else:
            # transformers' own cache: a request with sampling fields is sampled by kvplug's sampler
            # on the logits, any other by transformers as the checkpoint says (native_sampling)
            from kvplug_transformers.native_sampling import NativeRequestSampling

            self.sampling = NativeRequestSampling(model.generation_config, vocab_size, decode=decode, model=model)
        if engine_process:
            from kvplug_transformers.engine_client import RemoteGenerateManager, RemoteStats
            from kvplug_transformers.engine_protocol import EngineSpec

            def spec_for(generation_config: Any) -> EngineSpec:
                return EngineSpec(
                    model_path=served.path, device=str(device), dtype_name=dtype_name,
                    trust_remote_code=opts.trust_remote_code, cb_kwargs=cb_kwargs, kvplug_settings=kvplug_settings,
                    generation_config=generation_config, seed=opts.seed, log_level=opts.log_level,
                    uvicorn_log_level=opts.uvicorn_log_level, log_requests=opts.log_requests,
                    per_request_sampling=self.sampling is not None, stream_interval=opts.stream_interval,
                )

            generation_state._cb_manager = RemoteGenerateManager(spec_for, self.sampling, api_server)
            generation_state._cb_model_id = served.name  # the id the guarded handlers resolve the model to
            self.stats_source = RemoteStats(generation_state, adapter)
        self.watch = WorkerWatch(generation_state, limits, inflight, self.sampling)
        self.bytes_per_token = tokenizer_bytes_per_token(processor, served.path)
        self.tokenizer = OffLoopTokenizer()
        guarded = guard_handlers(
            handlers["chat"], handlers["completion"], handlers["response"], served, limits, self.bytes_per_token,
            self.tokenizer, opts.trust_request_chat_template, self.sampling,
        )
        app = build_server(
            self.model_manager, handlers["chat"], completion_handler=handlers["completion"],
            response_handler=handlers["response"], transcription_handler=None, generation_state=generation_state,
        )
        self.metrics = ServeMetrics()
        add_generation_routes(app, guarded, self.tokenizer, self.watch.cancel, self.metrics)
        add_kvplug_routes(app, self.stats_source, opts, served, generation_state, self.watch, inflight, connections,
                          ready=self.ready)
        add_token_routes(app, processor, self.tokenizer, served, limits, _versions())
        add_cache_routes(app, adapter, opts)  # issue 27
        add_metrics_route(
            app, self.metrics, served.name,
            lambda: self.stats_source.stats().to_json() if opts.kv_backend == "kvplug" else {}, inflight.count,
        )
        wrap_app(app, api_key=opts.api_key, max_request_bytes=opts.max_request_bytes, inflight=inflight)
        self._sockets = None  # uvicorn binds its own; with several API servers, the shared one
        if api_server is not None:
            add_api_server_header(app, api_server.index)
            self._sockets = [api_server.sock]
        config = uvicorn.Config(
            app, host=opts.host, port=opts.port, log_config=None, log_level=opts.uvicorn_log_level or opts.log_level,
            # uvicorn's own check counts the connection asking too; ours refuses beyond the cap
            http=connections.protocol(), limit_concurrency=connections.max_connections + 1,
            timeout_keep_alive=opts.timeout_keep_alive, backlog=ACCEPT_BACKLOG,
        )
        self.uvicorn = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.uvicorn.serve(sockets=self._sockets))

        self.thread = threading.Thread(target=run, name="uvicorn-thread", daemon=False)
        self.thread.start()

    def start_worker(self, stop: threading.Event, others: Any = None, poll_s: float = 0.05) -> bool:
        """Start transformers' batching worker now, as the first request would, and wait until it
        has built its batch processor (kvplug's KV pool, or transformers' own cache) and captured
        kvplug's decode CUDA graphs when they are on (``worker_warmup``): a pool that cannot be
        built fails the start, not the first request; with ``others`` (``api_servers.ApiServers``),
        until they serve too. Returns False when ``stop`` came first.

        Raises:
            KVPlugError: the worker died while building, or the capture failed (its error in the message).
        """
        model_id, model, processor = self._chat._resolve_model({})
        modality = self.model_manager.get_model_modality(model, processor=processor)
        if not self.generation_state.use_continuous_batching(model, modality):
            raise KVPlugError(f"transformers will not run {model_id} with continuous batching; kvplug serve needs it")
        manager = self.generation_state.get_manager(model_id, use_cb=True)  # through WorkerWatch: RequestLimits apply
        manager.init_cb(model, model.generation_config)
        requested, warmup = False, None  # the decode-graph capture on the batching thread, once the pool is built
        while not stop.is_set():
            error = self.watch.worker_error()
            if error is not None:
                raise KVPlugError(f"the batching worker failed while building the KV cache: {error}")
            batching = getattr(getattr(self.generation_state, "_cb_manager", None), "_cb", None)
            if not requested and batching is not None and getattr(batching, "batch_processor", None) is not None:
                requested, warmup = True, request_warmup(batching, model)
            if requested and (warmup is None or warmup.done()):
                if warmup is not None and warmup.exception() is not None:
                    error = warmup.exception()
                    raise KVPlugError(
                        f"capturing kvplug's decode CUDA graphs failed: {type(error).__name__}: {error} "
                        "(--disable-cuda-graph serves without them)"
                    ) from error
                if others is None or others.all_ready():
                    self.ready.set()
                    return True
            stop.wait(poll_s)
        return False

    def stop_engine(self, timeout: float) -> bool:
        """``--engine-process``: wait up to ``timeout`` s for the engine process to exit after its
        stop, then kill it; ``True`` when it exited by itself (or there is none)."""
        engine = getattr(self.generation_state._cb_manager, "engine", None)
        return True if engine is None else engine.terminate(timeout)

    @property
    def started(self) -> bool:
        return bool(self.uvicorn.started)

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def _pinned() -> None:
    """``TimedModel.reset_timer`` of the one model this server serves: nothing to restart."""


def tokenizer_bytes_per_token(processor: Any, path: str) -> int:
    """The most UTF-8 bytes one token's text takes in ``processor``'s vocabulary (an upper bound
    of the text bytes one token covers); a model without a usable tokenizer fails here, at start."""
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES):
        # transformers then builds an empty tokenizer and every request fails
        raise KVPlugError(
            f"the model in {path} has no tokenizer: kvplug serve needs one of {', '.join(TOKENIZER_FILES)} next to "
            "config.json"
        )
    tokenizer = getattr(processor, "tokenizer", processor)
    try:
        vocab = tokenizer.get_vocab()
        _ = tokenizer._tokenizer  # transformers' streaming decodes with the fast (Rust) tokenizer
    except Exception as error:
        raise KVPlugError(
            f"the model in {path} has no usable tokenizer ({type(error).__name__}: {error}); kvplug serve needs "
            "tokenizer.json (or the files to build a fast tokenizer) next to config.json"
        ) from error
    if len(vocab) < 2:
        raise KVPlugError(f"the tokenizer of the model in {path} has {len(vocab)} token(s): not a usable tokenizer")
    return max(len(token.encode("utf-8", errors="replace")) for token in vocab)


def _versions() -> str:
    """``GET /version``: kvplug's version (vLLM answers its own there)."""
    import kvplug

    return kvplug.__version__
