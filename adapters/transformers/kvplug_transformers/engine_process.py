"""The engine process of ``kvplug serve --engine-process``: the model, transformers'
``ContinuousBatchingManager`` and kvplug, off the HTTP process's interpreter.

``run_engine`` is the process's target. Its main thread reads the frontends' messages
(``engine_protocol``; one frontend, or one per API server with ``--api-server-count``:
``engine_links``) and submits, cancels or stops; a sender thread drains the batching worker's
output queue and sends one ``STEP`` message per drained batch (per frontend) with each request's
new token ids. The process ignores SIGINT / SIGTERM: the frontend stops it (its pipe closing
included), so a signal to the whole process group still gets the bounded shutdown.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
from typing import Any

from kvplug.interface import KVPlugError

from kvplug_transformers import engine_protocol as protocol
from kvplug_transformers.engine_links import OWNER, FrontendLinks
from kvplug_transformers.worker_warmup import request_warmup

logger = logging.getLogger("kvplug.engine")
READY_POLL_S = 0.02
OUTPUT_POLL_S = 0.05  # how often an idle sender looks for the worker's death


def run_engine(conn: Any, spec: protocol.EngineSpec, other_conns: tuple = ()) -> None:
    """Build the model and the batching worker as ``kvplug serve`` does, then serve ``conn`` (the
    owning frontend) and ``other_conns`` (the other API servers' connections)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from kvplug_transformers.server import _configure_logging

    _configure_logging(spec.log_level, spec.uvicorn_log_level, log_requests=spec.log_requests)
    links = FrontendLinks([conn, *other_conns])
    try:
        host, manager, sampling = _build(spec)
    except Exception as error:  # whatever stops the build is the start's failure, told to the frontends
        links.broadcast((protocol.FATAL, f"{type(error).__name__}: {error}"))
        sys.exit(1)  # the frontend reports it (no traceback in the server's log)
    sender = _OutputSender(manager, links, spec.stream_interval)
    threading.Thread(target=sender.run, name="kvplug-engine-sender", daemon=True).start()
    links.broadcast((protocol.READY, _pid()))
    try:
        _serve(links, manager, host, sampling, sender)
    finally:
        sender.stop()
        try:
            links.broadcast((protocol.STOPPED, host.stats() if host is not None else None))
        except OSError:  # the frontend is gone
            pass


def _build(spec: protocol.EngineSpec) -> tuple[Any, Any, Any]:
    """(the kvplug host or ``None``, the started batching manager, the ``RequestSampling`` of
    ``spec.per_request_sampling`` or ``None``)."""
    import torch
    from transformers import ContinuousBatchingConfig
    from transformers.cli.serving.model_manager import ModelManager

    if spec.seed is not None:
        torch.manual_seed(spec.seed)
    host = None
    if spec.kvplug_settings is not None:
        from kvplug_transformers.host import TransformersHost

        host = TransformersHost(spec.kvplug_settings).install()
    models = ModelManager(device=spec.device, dtype=spec.dtype_name, force_model=spec.model_path,
                          trust_remote_code=spec.trust_remote_code)
    model, processor = models.load_model_and_processor(models.process_model_name(spec.model_path))
    sampling = None
    vocab_size = model.config.get_text_config().vocab_size
    decode = lambda ids: processor.decode(ids, skip_special_tokens=True)  # noqa: E731
    # what the in-process server builds: each request's SamplingParams come with its ADD
    if spec.per_request_sampling and host is not None:
        from kvplug_transformers.request_sampling import RequestSampling

        sampling = RequestSampling(model.generation_config, vocab_size, decode=decode)
        host.sample_per_request(sampling)
    elif spec.per_request_sampling:  # transformers' own cache: kvplug's sampler for the requests that ask
        from kvplug_transformers.native_sampling import NativeRequestSampling

        sampling = NativeRequestSampling(model.generation_config, vocab_size, decode=decode, model=model)
    config = ContinuousBatchingConfig(**spec.cb_kwargs) if spec.cb_kwargs else None
    manager = model.init_continuous_batching(generation_config=spec.generation_config,
                                             continuous_batching_config=config)
    if sampling is not None:
        sampling.started(manager)
    manager.start()
    # the pool is built: what cannot be built fails now
    _wait_for(manager, lambda: getattr(manager, "batch_processor", None) is not None, "building the KV cache")
    warmup = request_warmup(manager, model)  # decode CUDA graphs captured before READY (worker_warmup)
    if warmup is not None:
        _wait_for(manager, warmup.done, "capturing the decode CUDA graphs")
    if warmup is not None and warmup.exception() is not None:
        error = warmup.exception()
        raise KVPlugError(f"capturing kvplug's decode CUDA graphs failed: {type(error).__name__}: {error} "
                          "(--disable-cuda-graph serves without them)") from error
    return host, manager, sampling


def _wait_for(manager: Any, done: Any, doing: str) -> None:
    """Until ``done()``; the worker's death (its error, or its thread gone) raises."""
    status = manager.background_thread_status
    while not done():
        if status.fatal_error is not None:
            raise status.fatal_error
        thread = getattr(manager, "_generation_thread", None)
        if thread is not None and thread.ident is not None and not thread.is_alive():
            raise RuntimeError(f"the batching worker exited while {doing}")
        threading.Event().wait(READY_POLL_S)


def _serve(links: FrontendLinks, manager: Any, host: Any, sampling: Any, sender: _OutputSender) -> None:
    while True:
        for frontend, message in links.receive():
            if message is None and frontend == OWNER:  # the owning frontend died: stop
                logger.warning("kvplug engine: the HTTP process is gone; stopping")
                manager.stop(block=True, timeout=2)
                return
            if message is None:  # another API server is gone: its requests go with it
                logger.warning("kvplug engine: API server %d is gone; its requests are cancelled", frontend)
                _detach(links, frontend, manager, sampling, sender)
                continue
            kind = message[0]
            if kind == protocol.ADD:
                _, request_id, input_ids, max_new_tokens, eos_token_id, streaming, params = message
                if params is not None:
                    refusal = _refusal(sampling, params)
                    if refusal is not None:
                        links.send(frontend, (protocol.STEP, [protocol.StepOutput(request_id, [], True, refusal)]))
                        continue
                engine_id = links.admit(frontend, request_id)
                if params is not None:
                    sampling.register(engine_id, params)
                manager.add_request(input_ids, request_id=engine_id, streaming=streaming,
                                    max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
            elif kind == protocol.CANCEL:
                engine_id = links.engine_id(frontend, message[1])
                links.forget(engine_id)
                _cancel(engine_id, manager, sampling, sender)
            elif kind == protocol.STATS:
                links.send(frontend, (protocol.STATS_REPLY, message[1],
                                      host.stats() if host is not None else _native_stats(manager)))
            elif kind == protocol.STOP and frontend != OWNER:  # an API server stopping: only it goes
                _detach(links, frontend, manager, sampling, sender, (protocol.STOPPED, None))
            elif kind == protocol.STOP:
                status = manager.background_thread_status
                status.request_stop(status.HARD_STOP, manager.distributed_helper.global_rank)
                manager._has_new_requests.set()  # wake it if it waits for requests
                thread = getattr(manager, "_generation_thread", None)
                if thread is not None:
                    thread.join(timeout=message[1])
                return


def _cancel(engine_id: str, manager: Any, sampling: Any, sender: _OutputSender) -> None:
    sender.forget(engine_id)
    if sampling is not None:
        sampling.discard(engine_id)
    manager.cancel_request(engine_id)


def _detach(links: FrontendLinks, frontend: int, manager: Any, sampling: Any, sender: _OutputSender,
            last: tuple | None = None) -> None:
    """An API server's requests cancelled, ``last`` sent to it, its connection closed."""
    if last is not None:
        links.send(frontend, last)
    for engine_id in links.detach(frontend):
        _cancel(engine_id, manager, sampling, sender)


class _OutputSender:
    """Drains the worker's output queue into ``STEP`` messages (new token ids only); reports the
    worker's death (``FATAL``) before the failed outputs it delivers. With ``interval`` > 1 a
    request's tokens wait until that many are new (``--stream-interval``); its first token and its
    end are sent at once."""

    def __init__(self, manager: Any, links: FrontendLinks, interval: int = 1) -> None:
        self._manager = manager
        self._links = links
        self._interval = interval
        self._sent: dict[str, int] = {}  # request id -> tokens already sent
        self._stopped = threading.Event()
        self._fatal_sent = False

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        outputs = self._manager.output_router.output_queue
        while not self._stopped.is_set():
            try:
                batch = [outputs.get(timeout=OUTPUT_POLL_S)]
            except queue.Empty:
                self._check_fatal()
                continue
            try:
                while True:
                    batch.append(outputs.get_nowait())
            except queue.Empty:
                pass
            items = [item for item in map(self._delta, batch) if item is not None]
            self._check_fatal()
            if not items:
                continue
            try:
                self._links.send_outputs(items)
            except OSError:  # the owning frontend is gone
                return

    def _delta(self, output: Any) -> protocol.StepOutput | None:
        """The output's new tokens, or ``None`` while fewer than the interval wait (after the first)."""
        tokens = output.generated_tokens
        done = self._sent.get(output.request_id, 0)
        finished = output.error is not None or output.is_finished()
        if not finished and done and len(tokens) - done < self._interval:
            return None
        if finished:
            self._sent.pop(output.request_id, None)
        else:
            self._sent[output.request_id] = len(tokens)
        error = None if output.error is None else str(output.error)
        return protocol.StepOutput(output.request_id, list(tokens[done:]), finished, error)

    def _check_fatal(self) -> None:
        error = self._manager.background_thread_status.fatal_error
        if error is not None and not self._fatal_sent:
            self._fatal_sent = True
            try:
                self._links.broadcast((protocol.FATAL, f"{type(error).__name__}: {error}"))
            except OSError:
                pass


def _refusal(sampling: Any, params: Any) -> str | None:
    """Why this engine cannot sample a request's own ``params`` (``None``: it can)."""
    if sampling is None:  # the frontend sends none without per_request_sampling
        return "this engine samples with the checkpoint's settings only"
    try:
        sampling.admit(params)  # the engine's worker may replay its sampling (the frontend cannot know)
    except KVPlugError as error:
        return str(error)
    return None


def _native_stats(manager: Any) -> dict | None:
    """What ``stats_routes`` reads of transformers' own paged cache (``--kv-backend native``)."""
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    if cache is None:
        return None
    return {"num_blocks": int(cache.num_blocks), "free_blocks": int(cache.get_num_free_blocks()),
            "prefix_length": int(getattr(cache, "_total_prefix_length", 0)), "block_size": int(cache.block_size)}


def _pid() -> int:
    return os.getpid()
