"""``WorkerWatch``: transformers' continuous-batching worker, guarded and watched.

transformers runs every request of ``kvplug serve`` on one worker thread
(``ContinuousBatchingManager._run_generation_loop``). An exception there stops it for every
request, and transformers then answers 503 forever. The watch:

* puts ``RequestLimits`` between the handlers and the worker: a request that cannot fit is refused
  before submission, ``max_new_tokens`` is lowered to the room left;
* refuses to hand out a manager (so no worker starts) once the server is closing;
* notices a dead worker (``worker_error``), and stops the worker within a time bound.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from abc import ABC, abstractmethod
from typing import Any

from kvplug_transformers.coalesced_stream import CoalescedQueue
from kvplug_transformers.http_guards import InFlightRequests
from kvplug_transformers.request_limits import RequestLimits, RequestRefused
from kvplug_transformers.stop_strings import StopStringQueue, cut_at_stop

logger = logging.getLogger("kvplug.serve")
CAUSE_WAIT_S = 2.0  # how long a dying worker is given to record why, for the log and the 503s


class WorkerSampling(ABC):
    """How the batching worker samples: the config it starts with, and what a request may ask."""

    @abstractmethod
    def config(self, model: Any) -> Any:
        """The generation config the worker starts with."""

    @abstractmethod
    def check(self, model: Any, requested: Any) -> None:
        """Raise ``RequestRefused`` for a request's generation config the worker would not honour."""

    def discard(self, request_id: str) -> None:
        """A request refused before it reached the worker."""

    def started(self, manager: Any) -> None:
        """The worker's batching manager is built, before any request reaches it (transformers'
        ``ContinuousBatchingManager``, or an engine process's stand-in)."""

    def stops(self, request_id: str) -> tuple[str, ...]:
        """A request's stop strings, which its response is cut at (none unless registered)."""
        return ()


class LimitedManager:
    """A transformers generation manager whose requests pass ``RequestLimits`` first, and whose
    worker starts with the server's sampling (``WorkerSampling``) rather than its first request's."""

    def __init__(self, inner: Any, limits: RequestLimits, sampling: WorkerSampling) -> None:
        self._inner = inner
        self._limits = limits
        self._sampling = sampling

    def init_cb(self, model: Any, generation_config: Any) -> None:
        """transformers starts the worker with the first request's generation config and then
        applies its sampling to every request; start it with the server's instead, and refuse a
        request asking for other sampling (it would be silently ignored)."""
        self._sampling.check(model, generation_config)
        started = getattr(self._inner, "_cb", None) is not None
        self._inner.init_cb(model, self._sampling.config(model))
        if not started:
            self._sampling.started(getattr(self._inner, "_cb", None))

    def generate_streaming(self, model: Any, processor: Any, inputs: Any, generation_config: Any, **kwargs: Any) -> Any:
        self._apply_limits(inputs, generation_config, kwargs)
        self._log(inputs, generation_config, kwargs, streaming=True)
        stops = self._sampling.stops(kwargs.get("request_id"))
        queue, streamer = self._inner.generate_streaming(model, processor, inputs, generation_config, **kwargs)
        return CoalescedQueue(StopStringQueue(queue, stops) if stops else queue), streamer

    async def generate_non_streaming(
        self, model: Any, processor: Any, inputs: Any, generation_config: Any, **kwargs: Any
    ) -> Any:
        self._apply_limits(inputs, generation_config, kwargs)
        self._log(inputs, generation_config, kwargs, streaming=False)
        stops = self._sampling.stops(kwargs.get("request_id"))
        try:
            text, input_len, generated_ids = await self._inner.generate_non_streaming(
                model, processor, inputs, generation_config, **kwargs
            )
            return cut_at_stop(text, stops), input_len, generated_ids
        except asyncio.CancelledError:
            # aborted (shutdown, or the client is gone): transformers would keep generating it
            # to the end; free its row now, as its streaming path does
            manager = getattr(self._inner, "_cb", None)
            if manager is not None and kwargs.get("request_id") is not None:
                manager.cancel_request(kwargs["request_id"])
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _apply_limits(self, inputs: Any, generation_config: Any, kwargs: dict) -> None:
        try:
            self._limits.apply(inputs["input_ids"], generation_config)
        except RequestRefused:
            if kwargs.get("request_id") is not None:
                self._sampling.discard(kwargs["request_id"])
            raise

    @staticmethod
    def _log(inputs: Any, generation_config: Any, kwargs: dict, *, streaming: bool) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            ids = inputs["input_ids"]
            prompt_len = len(ids) if isinstance(ids, list) else int(ids.shape[-1])
            logger.debug(
                "request %s: %d prompt tokens, max_new_tokens %d%s", kwargs.get("request_id"), prompt_len,
                generation_config.max_new_tokens, ", streaming" if streaming else "",
            )


SAMPLING_FIELDS = ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "sequence_bias", "stop_strings",
                   "num_beams", "num_return_sequences")
NEUTRAL = {"repetition_penalty": 1.0, "sequence_bias": None, "stop_strings": None, "num_beams": 1,
           "num_return_sequences": 1}
OPENAI_NAMES = {"repetition_penalty": "frequency_penalty", "sequence_bias": "logit_bias", "stop_strings": "stop"}


class ServerSampling(WorkerSampling):
    """The one sampling setting of a server on transformers' native cache: the model's
    ``generation_config.json`` (with the kvplug cache every request samples its own way:
    ``request_sampling.RequestSampling``).

    transformers' continuous batching takes only ``max_new_tokens`` and the EOS token per
    request; everything else (temperature, top_p, penalties, logit bias, stop strings) comes from
    the config the worker started with. A request asking for something else is refused (400)
    instead of being served with settings it did not ask for."""

    def __init__(self) -> None:
        self._config: Any = None

    def config(self, model: Any) -> Any:
        if self._config is None:
            config = copy.deepcopy(model.generation_config)
            config.use_cache = False  # continuous batching manages its own paged cache
            self._config = config
        return self._config

    def check(self, model: Any, requested: Any) -> None:
        server = self._settings(self.config(model))
        asked = self._settings(requested)
        differing = [name for name in SAMPLING_FIELDS if asked.get(name) != server.get(name)]
        if differing:
            names = sorted({OPENAI_NAMES.get(name, name) for name in differing})
            raise RequestRefused(
                f"this server samples every request the same way ({self._describe(server)}, from the model's "
                f"generation_config.json): transformers' continuous batching does not apply per-request "
                f"{', '.join(names)}; this request asks for {self._describe(asked)}",
                param=names[0],
            )

    @staticmethod
    def _settings(config: Any) -> dict:
        values = {name: getattr(config, name, None) for name in SAMPLING_FIELDS}
        for name, neutral in NEUTRAL.items():
            if values[name] in (None, neutral, {}, []):
                values[name] = neutral
        if not values["do_sample"] or values["temperature"] == 0:
            # greedy: temperature, top_p and top_k play no part
            values.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            values["temperature"] = 1.0 if values["temperature"] is None else float(values["temperature"])
            values["top_p"] = 1.0 if values["top_p"] is None else float(values["top_p"])
        return values

    @staticmethod
    def _describe(settings: dict) -> str:
        if not settings["do_sample"]:
            shown = ["greedy"]
        else:
            shown = [f"temperature {settings['temperature']:g}", f"top_p {settings['top_p']:g}"]
            if settings["top_k"] is not None:
                shown.append(f"top_k {settings['top_k']}")
        shown += [
            f"{name} {settings[name]!r}" for name, neutral in NEUTRAL.items() if settings[name] != neutral
        ]
        return ", ".join(shown)


class WorkerWatch:
    """Guards ``generation_state`` (transformers' ``GenerationState``) in place.

    Args:
        generation_state: the server's ``GenerationState``; its ``get_manager`` is wrapped.
        limits: what one request may hold.
        inflight: the server's running requests; closed requests get no manager.
        sampling: how the worker samples (``ServerSampling`` when not given).
    """

    def __init__(self, generation_state: Any, limits: RequestLimits, inflight: InFlightRequests,
                 sampling: WorkerSampling | None = None) -> None:
        self._state = generation_state
        self.limits = limits
        self._inflight = inflight
        self._get_manager = generation_state.get_manager
        generation_state.get_manager = self.get_manager
        self.sampling = sampling if sampling is not None else ServerSampling()
        self.death: str | None = None
        self._stopping = False  # set when the server itself stops the worker

    def get_manager(self, model_id: str, use_cb: bool = False) -> LimitedManager:
        if self._inflight.closed_reason is not None:
            raise RequestRefused(self._inflight.closed_reason, status=503)
        return LimitedManager(self._get_manager(model_id, use_cb=use_cb), self.limits, self.sampling)

    def cancel(self, request_id: str) -> None:
        """Cancel a request in the batching worker (its row is freed at the worker's next step);
        one that already finished, or never started, is left as it is."""
        manager = self._batching_manager()
        if manager is not None:
            manager.cancel_request(request_id)

    def _batching_manager(self) -> Any:
        """transformers' ``ContinuousBatchingManager``, once the first request started it."""
        return getattr(getattr(self._state, "_cb_manager", None), "_cb", None)

    def worker_error(self) -> str | None:
        """Why the batching worker is dead, or ``None`` while it lives (or has not started)."""
        if self.death is not None:
            return self.death
        manager = self._batching_manager()
        if manager is None:
            return None
        status = manager.background_thread_status
        if status.fatal_error is not None:
            return f"{type(status.fatal_error).__name__}: {status.fatal_error}"
        if status.local_status >= status.HARD_STOP and not self._stopping:
            # transformers requests a hard stop first, fails every request, then records the error
            return "it is stopping after a fatal error"
        thread = getattr(manager, "_generation_thread", None)
        started = thread is not None and thread.ident is not None  # created but not yet started: not dead
        if started and not thread.is_alive() and status.local_status == status.DONT_STOP:
            return "its thread exited without an error"
        return None

    def check(self) -> str | None:
        """Look at the worker now; on the first sight of its death, close the server to new
        requests and abort the running ones. Returns the cause while it is dead."""
        if self.death is not None:
            return self.death
        error = self.worker_error()
        if error is not None:
            manager = self._batching_manager()
            deadline = time.monotonic() + CAUSE_WAIT_S
            while manager is not None and manager.background_thread_status.fatal_error is None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            error = self.worker_error() or error
            self.death = error
            reason = f"the batching worker died ({error}); kvplug serve is exiting"
            self._inflight.close(reason)
            aborted = self._inflight.abort_all(reason)
            logger.error("kvplug serve: the batching worker died: %s; %d running request(s) aborted", error, aborted)
        return self.death

    def stop_worker(self, timeout: float) -> bool:
        """Hard-stop the batching worker (its remaining requests fail) and wait up to
        ``timeout`` s; ``True`` when it has stopped."""
        self._stopping = True
        manager = self._batching_manager()
        if manager is None:
            return True
        thread = getattr(manager, "_generation_thread", None)
        if thread is None or not thread.is_alive():
            return True
        manager.background_thread_status.request_stop(
            manager.background_thread_status.HARD_STOP, manager.distributed_helper.global_rank
        )
        manager._has_new_requests.set()  # wake it if it waits for requests
        thread.join(timeout=max(timeout, 0.0))
        return not thread.is_alive()
