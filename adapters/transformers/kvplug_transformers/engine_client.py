"""The HTTP process's side of ``kvplug serve --engine-process``: transformers' batching manager,
as its serving handlers and ``WorkerWatch`` see it, backed by the engine process.

``RemoteGenerateManager`` is transformers' ``CBGenerateManager`` whose ``init_cb`` starts the
engine process (``engine_process.run_engine``) instead of a worker thread; its ``_cb`` is a
``RemoteBatchingManager``, which implements the part of ``ContinuousBatchingManager`` they call:
``add_request``, ``register_result_handler``, ``cancel_request``, ``background_thread_status``,
``batch_processor``, ``stop``. A reader thread receives the engine's one message per step and
hands it to the event loop in one ``call_soon_threadsafe``; the handlers' ``CBStreamer`` then
detokenises here, as before. The engine's death (a fatal error, or its process gone) reads as a
dead worker: ``WorkerWatch`` answers 503 and the server exits 2.

With ``--api-server-count N`` (``api_servers``) the first API server starts the engine process with
every API server's pipe; the others attach to theirs (``role``): the engine as they see it is that
pipe, and their stop detaches them from it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
from typing import Any, Callable

from transformers.cli.serving.utils import CBGenerateManager

from kvplug_transformers import engine_protocol as protocol
from kvplug_transformers.engine_process import run_engine

logger = logging.getLogger("kvplug.serve")
STATS_TIMEOUT_S = 5.0
EXIT_CODE_WAIT_S = 0.5  # for the log's exit code once the engine's pipe closed
DEFAULT_STOP_S = 5.0  # a stop without a time bound gets this one
STOP_MARGIN_S = 1.0  # after the stop's wait, what a process still alive is given after SIGKILL


class RemoteOutput:
    """What transformers' ``GenerationOutput`` offers its serving handlers: the tokens so far,
    the error, whether it finished."""

    __slots__ = ("request_id", "generated_tokens", "error", "_finished")

    def __init__(self, request_id: str, generated_tokens: list[int], error: str | None, finished: bool) -> None:
        self.request_id = request_id
        self.generated_tokens = generated_tokens
        self.error = error
        self._finished = finished

    def is_finished(self) -> bool:
        return self._finished


class EngineStatus:
    """transformers' ``BackgroundThreadStatus`` as ``WorkerWatch`` and the handlers read it."""

    DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED = 0, 1, 2, 3

    def __init__(self, engine: RemoteBatchingManager) -> None:
        self._engine = engine
        self.fatal_error: Exception | None = None
        self.local_status = self.DONT_STOP

    def request_stop(self, status: int, global_rank: int = 0) -> None:
        self.local_status = max(self.local_status, status)
        self._engine.send_stop()

    def record_fatal_error(self, error: Exception) -> None:
        if self.fatal_error is None:
            self.fatal_error = error
        self.local_status = max(self.local_status, self.HARD_STOP)


class EngineProcessError(RuntimeError):
    """The engine process's batching worker failed, or the process is gone."""


class _ProcessView:
    """The engine process where ``WorkerWatch`` looks for transformers' generation thread."""

    def __init__(self, process: Any) -> None:
        self._process = process

    @property
    def ident(self) -> int | None:
        return self._process.pid

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._process.join(timeout)


class _LinkView:
    """An attached API server's engine, where ``WorkerWatch`` looks for the generation thread:
    alive while its pipe to the engine is open."""

    def __init__(self, reader: threading.Thread) -> None:
        self._reader = reader

    @property
    def ident(self) -> int | None:
        return self._reader.ident

    def is_alive(self) -> bool:
        return self._reader.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._reader.join(timeout)


class _CacheSnapshot:
    """transformers' paged cache as ``stats_routes._native_stats`` reads it, from the engine."""

    def __init__(self, values: dict) -> None:
        self.num_blocks = values["num_blocks"]
        self.block_size = values["block_size"]
        self._total_prefix_length = values["prefix_length"]
        self._free = values["free_blocks"]

    def get_num_free_blocks(self) -> int:
        return self._free


class _RemoteProcessor:
    """Stands for the worker's batch processor once the engine is ready."""

    def __init__(self, engine: RemoteBatchingManager) -> None:
        self._engine = engine

    @property
    def cache(self) -> _CacheSnapshot | None:
        values = self._engine.query_stats()
        return _CacheSnapshot(values) if isinstance(values, dict) else None


class _NoWait:
    def set(self) -> None:  # the engine wakes itself; WorkerWatch.stop_worker calls this
        pass


class _Rank:
    global_rank = 0


class _Request:
    __slots__ = ("tokens", "callback", "pending")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.callback: Callable[[RemoteOutput], None] | None = None
        self.pending: list[RemoteOutput] = []


class RemoteBatchingManager:
    """transformers' ``ContinuousBatchingManager`` surface, served by the engine process."""

    def __init__(self, spec: protocol.EngineSpec, sampling: Any = None, role: Any = None) -> None:
        self._sampling = sampling  # the handlers' RequestSampling: each request's settings go with its ADD
        self._process = None  # an attached API server (role without engine_ends) starts none
        if role is None:
            context = multiprocessing.get_context("spawn")  # CUDA cannot be forked; nothing inherited by accident
            self._conn, child = context.Pipe(duplex=True)
            self._start_engine(context, spec, child)
        else:  # --api-server-count: this API server's pipe, the engine's ends if it starts the engine
            self._conn = role.connection
            if role.engine_ends:
                self._start_engine(multiprocessing.get_context("spawn"), spec, *role.engine_ends)
        self._send_lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queries: dict[int, concurrent.futures.Future] = {}
        self._query_ids = itertools.count()
        self._stop_sent = False
        self.last_stats: Any = None
        self.background_thread_status = EngineStatus(self)
        self.batch_processor: _RemoteProcessor | None = None
        self.distributed_helper = _Rank()
        self._has_new_requests = _NoWait()
        self._reader = threading.Thread(target=self._read, name="kvplug-engine-reader", daemon=True)
        self._generation_thread = _ProcessView(self._process) if self._process is not None else _LinkView(self._reader)
        self._reader.start()

    def _start_engine(self, context: Any, spec: protocol.EngineSpec, child: Any, *others: Any) -> None:
        self._process = context.Process(target=run_engine, args=(child, spec, others), name="kvplug-engine",
                                        daemon=True)
        self._process.start()
        for end in (child, *others):
            end.close()

    # ------------------------------------------------------------ what the handlers call
    def add_request(self, input_ids: list[int], request_id: str, streaming: bool = False,
                    max_new_tokens: int | None = None, eos_token_id: Any = None, **_: Any) -> str:
        self._loop = asyncio.get_running_loop()
        self._requests.setdefault(request_id, _Request())
        params = self._sampling.take(request_id) if self._sampling is not None else None
        self._send((protocol.ADD, request_id, list(input_ids), max_new_tokens, eos_token_id, streaming, params))
        return request_id

    def register_result_handler(self, request_id: str, callback: Callable[[RemoteOutput], None]) -> None:
        self._loop = asyncio.get_running_loop()
        request = self._requests.setdefault(request_id, _Request())
        request.callback = callback
        pending, request.pending = request.pending, []
        for output in pending:
            callback(output)

    def cancel_request(self, request_id: str) -> None:
        if self._sampling is not None:
            self._sampling.discard(request_id)
        if self._requests.pop(request_id, None) is not None:
            self._send_quietly((protocol.CANCEL, request_id))

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        self.send_stop(timeout)
        if block:
            self.terminate(timeout if timeout is not None else DEFAULT_STOP_S)

    # ------------------------------------------------------------ server side
    def send_stop(self, timeout: float | None = None) -> None:
        if not self._stop_sent:
            self._stop_sent = True
            self._send_quietly((protocol.STOP, DEFAULT_STOP_S if timeout is None else timeout))

    def terminate(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the engine to exit, then kill it; ``True`` if it exited in time
        (an attached API server: for its pipe to close)."""
        if self._process is None:
            self._reader.join(max(timeout, 0.0))
            return not self._reader.is_alive()
        self._process.join(max(timeout, 0.0))
        if self._process.is_alive():
            self._process.kill()
            self._process.join(STOP_MARGIN_S)
            return False
        return True

    def query_stats(self) -> Any:
        """The engine's ``HostStats`` (kvplug) or cache counters (native); the last ones once it stopped."""
        if not self._generation_thread.is_alive() or self.background_thread_status.fatal_error is not None:
            return self.last_stats
        query = next(self._query_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queries[query] = future
        try:
            self._send((protocol.STATS, query))
            self.last_stats = future.result(timeout=STATS_TIMEOUT_S)
        except (OSError, concurrent.futures.TimeoutError) as error:
            logger.debug("kvplug serve: engine statistics not answered: %s", error)
        finally:
            self._queries.pop(query, None)
        return self.last_stats

    # ------------------------------------------------------------ internals
    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _send_quietly(self, message: tuple) -> None:
        try:
            self._send(message)
        except OSError:  # the engine is gone; the reader reports it
            pass

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if self._process is not None:
                    self._process.join(EXIT_CODE_WAIT_S)
                    why = f"the engine process exited (exit code {self._process.exitcode})"
                else:
                    why = "the engine process exited (its pipe to this API server closed)"
                if not self._stop_sent:  # a stop asked for is no death
                    self.background_thread_status.record_fatal_error(EngineProcessError(why))
                for future in list(self._queries.values()):  # no answer will come: the last statistics
                    if not future.done():
                        future.set_result(self.last_stats)
                self._fail_pending(why)
                return
            kind = message[0]
            if kind == protocol.STEP:
                loop = self._loop
                if loop is not None and not loop.is_closed():
                    try:
                        loop.call_soon_threadsafe(self._dispatch, message[1])
                    except RuntimeError:  # the loop closed meanwhile: the server is stopping
                        pass
            elif kind == protocol.STATS_REPLY:
                future = self._queries.get(message[1])
                if future is not None and not future.done():
                    future.set_result(message[2])
            elif kind == protocol.READY:
                self.batch_processor = _RemoteProcessor(self)
            elif kind == protocol.FATAL:
                self.background_thread_status.record_fatal_error(EngineProcessError(message[1]))
            elif kind == protocol.STOPPED:
                self.last_stats = message[1]

    def _fail_pending(self, why: str) -> None:
        """Requests the engine will never answer get a failed output (their handlers end)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._fail_all, why)
            except RuntimeError:
                pass

    def _fail_all(self, why: str) -> None:
        requests, self._requests = self._requests, {}
        for request_id, request in requests.items():
            self._deliver(request, RemoteOutput(request_id, request.tokens, why, True))

    def _dispatch(self, items: list[protocol.StepOutput]) -> None:
        """On the event loop: one engine step's outputs to their handlers."""
        requests = self._requests
        for request_id, new_tokens, finished, error in items:
            request = requests.get(request_id)
            if request is None:
                continue  # cancelled
            request.tokens.extend(new_tokens)
            if finished:
                del requests[request_id]
            self._deliver(request, RemoteOutput(request_id, request.tokens, error, finished))

    @staticmethod
    def _deliver(request: _Request, output: RemoteOutput) -> None:
        if request.callback is None:
            request.pending.append(output)
            return
        try:
            request.callback(output)
        except Exception:  # one handler's failure never stops the others' delivery
            logger.exception("kvplug serve: delivering request %s's output failed", output.request_id)


class RemoteGenerateManager(CBGenerateManager):
    """transformers' ``CBGenerateManager`` with the batching worker in the engine process;
    ``spec_for(generation_config)`` says what the engine builds; ``sampling`` (a
    ``RequestSampling``, or ``None``) is where each request's sampling is taken from when it is sent;
    ``role`` (``--api-server-count``) is this API server's pipe to the engine."""

    def __init__(self, spec_for: Callable[[Any], protocol.EngineSpec], sampling: Any = None, role: Any = None) -> None:
        super().__init__(cb_config=None)
        self._spec_for = spec_for
        self._sampling = sampling
        self._role = role  # --api-server-count: an api_servers.ApiServerRole

    def init_cb(self, model: Any, gen_config: Any) -> None:
        if self._cb is None:
            self._cb = RemoteBatchingManager(self._spec_for(gen_config), self._sampling, self._role)

    @property
    def engine(self) -> RemoteBatchingManager | None:
        return self._cb


class RemoteStats:
    """Where ``/kvplug/stats``, ``/health`` and ``/metrics`` read kvplug's ``HostStats`` from: the
    engine process (the adapter in the HTTP process is not installed there)."""

    def __init__(self, generation_state: Any, fallback: Any) -> None:
        self._state = generation_state
        self._fallback = fallback

    def stats(self) -> Any:
        engine = getattr(self._state._cb_manager, "engine", None)
        values = engine.query_stats() if engine is not None else None
        return values if values is not None else self._fallback.stats()

    def kv_events_stats(self) -> None:
        """No KV events with an engine process (``--kv-events-config`` is refused with it)."""
        return None
