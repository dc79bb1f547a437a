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

import logging
from typing import Any

from kvplug_transformers.http_guards import InFlightRequests
from kvplug_transformers.request_limits import RequestLimits, RequestRefused

logger = logging.getLogger("kvplug.serve")


class LimitedManager:
    """A transformers generation manager whose requests pass ``RequestLimits`` first."""

    def __init__(self, inner: Any, limits: RequestLimits) -> None:
        self._inner = inner
        self._limits = limits

    def init_cb(self, model: Any, generation_config: Any) -> None:
        self._inner.init_cb(model, generation_config)

    def generate_streaming(self, model: Any, processor: Any, inputs: Any, generation_config: Any, **kwargs: Any) -> Any:
        self._limits.apply(inputs["input_ids"], generation_config)
        self._log(inputs, generation_config, kwargs, streaming=True)
        return self._inner.generate_streaming(model, processor, inputs, generation_config, **kwargs)

    async def generate_non_streaming(
        self, model: Any, processor: Any, inputs: Any, generation_config: Any, **kwargs: Any
    ) -> Any:
        self._limits.apply(inputs["input_ids"], generation_config)
        self._log(inputs, generation_config, kwargs, streaming=False)
        return await self._inner.generate_non_streaming(model, processor, inputs, generation_config, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @staticmethod
    def _log(inputs: Any, generation_config: Any, kwargs: dict, *, streaming: bool) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            ids = inputs["input_ids"]
            prompt_len = len(ids) if isinstance(ids, list) else int(ids.shape[-1])
            logger.debug(
                "request %s: %d prompt tokens, max_new_tokens %d%s", kwargs.get("request_id"), prompt_len,
                generation_config.max_new_tokens, ", streaming" if streaming else "",
            )


class WorkerWatch:
    """Guards ``generation_state`` (transformers' ``GenerationState``) in place.

    Args:
        generation_state: the server's ``GenerationState``; its ``get_manager`` is wrapped.
        limits: what one request may hold.
        inflight: the server's running requests; closed requests get no manager.
    """

    def __init__(self, generation_state: Any, limits: RequestLimits, inflight: InFlightRequests) -> None:
        self._state = generation_state
        self.limits = limits
        self._inflight = inflight
        self._get_manager = generation_state.get_manager
        generation_state.get_manager = self.get_manager
        self.death: str | None = None

    def get_manager(self, model_id: str, use_cb: bool = False) -> LimitedManager:
        if self._inflight.closed_reason is not None:
            raise RequestRefused(self._inflight.closed_reason, status=503)
        return LimitedManager(self._get_manager(model_id, use_cb=use_cb), self.limits)

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
        thread = getattr(manager, "_generation_thread", None)
        if thread is not None and not thread.is_alive() and status.local_status == status.DONT_STOP:
            return "its thread exited without an error"
        return None

    def check(self) -> str | None:
        """Look at the worker now; on the first sight of its death, close the server to new
        requests and abort the running ones. Returns the cause while it is dead."""
        if self.death is not None:
            return self.death
        error = self.worker_error()
        if error is not None:
            self.death = error
            reason = f"the batching worker died ({error}); kvplug serve is exiting"
            self._inflight.close(reason)
            aborted = self._inflight.abort_all(reason)
            logger.error("kvplug serve: the batching worker died: %s; %d running request(s) aborted", error, aborted)
        return self.death

    def stop_worker(self, timeout: float) -> bool:
        """Hard-stop the batching worker (its remaining requests fail) and wait up to
        ``timeout`` s; ``True`` when it has stopped."""
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
