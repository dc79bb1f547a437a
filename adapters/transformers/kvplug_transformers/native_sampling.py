"""``NativeRequestSampling``: each request's sampling on ``kvplug serve --kv-backend native`` (issue 29 item 2).

transformers' continuous batching samples every request with the one generation config its worker
started with; it takes temperature, top-k and top-p per request (``per_request_processors``,
``add_request(**logit_processor_kwargs)``) only where that config already samples with them, and
has one worker-wide ``do_sample`` and one random stream: no per-request greedy, seed, min-p,
penalties or stop strings. So a request that sends sampling fields is sampled by kvplug's sampler
on the logits (``NativeStepSampler``), each field meaning what it means on the kvplug cache (one
seed, the same tokens on both backends); transformers' own per-request settings are what keeps
its logits raw: such a request asks the worker's per-request processors for temperature 1, top-k
the vocabulary and top-p 1. A request that sends none (or only the checkpoint's own values) is
transformers' own, untouched: the A/B baseline.

What cannot be honoured is a 400 naming the field: a logits processor the checkpoint's
``generation_config.json`` gives the worker that has no per-request version (min-p, typical-p, ...:
transformers applies it to every row), and transformers' CUDA graphs or ``torch.compile`` of its
step (a replay repeats the sampling captured once).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

from kvplug_transformers.native_installation import install_native_sampler
from kvplug_transformers.native_step_sampler import NativeStepSampler
from kvplug_transformers.request_limits import RequestRefused
from kvplug_transformers.request_sampling import RequestSampling
from kvplug_transformers.sampling_params import SamplingParams

WAY_OUT = "serve with --kv-backend kvplug (the default), which samples each request its own way"


class NativeRequestSampling(RequestSampling):
    """``RequestSampling`` for transformers' own cache: only requests that ask for their own sampling
    are registered (``admit``), the worker starts with the checkpoint's generation config.

    Args:
        generation_config, vocab_size, decode: as ``RequestSampling``.
        model: the served model (its worker's logits processors are read from it); ``None``: none.
    """

    def __init__(self, generation_config: Any, vocab_size: int, decode: Callable[[list[int]], str] | None = None,
                 model: Any = None) -> None:
        super().__init__(generation_config, vocab_size, decode)
        self.fixed, keys = worker_processors(model) if model is not None else ((), set())
        # what makes transformers' per-request processors leave a row's logits as they are
        self.neutral = {key: value for key, value in (("temperature", 1.0), ("top_p", 1.0), ("top_k", vocab_size))
                        if key in keys}
        self.worker_limit: str | None = None  # why the started worker cannot let kvplug sample (graphs, compile)
        self.step_sampler = NativeStepSampler(self, decode)

    def take(self, request_id: str) -> SamplingParams | None:  # type: ignore[override]
        """A registered request's settings, forgotten here; ``None`` for any other (transformers samples it)."""
        with self._lock:
            return self._params.pop(request_id, None)

    def admit(self, params: SamplingParams) -> SamplingParams | None:
        """``None`` when ``params`` are the checkpoint's own (transformers samples the request);
        otherwise ``params``, or ``RequestRefused`` (400) when this worker cannot let kvplug sample it."""
        if params == self.defaults:
            return None
        reason = self.worker_limit or (
            f"the model's generation_config.json gives transformers' worker {', '.join(self.fixed)}, which its "
            "continuous batching applies to every request (no per-request version)" if self.fixed else None
        )
        if reason is not None:
            name = next(field.name for field in dataclasses.fields(SamplingParams)
                        if getattr(params, field.name) != getattr(self.defaults, field.name))
            raise RequestRefused(
                f"{name} {getattr(params, name)!r} cannot be honoured with --kv-backend native: {reason}; "
                f"send no sampling fields (the checkpoint's sampling), or {WAY_OUT}",
                param=name,
            )
        return params

    def config(self, model: Any) -> Any:
        """The worker's generation config: the checkpoint's, as transformers would start it."""
        if self._config is None:
            config = copy.deepcopy(model.generation_config)
            config.use_cache = False  # continuous batching manages its own paged cache
            self._config = config
        return self._config

    def started(self, manager: Any) -> None:
        """transformers' ``ContinuousBatchingManager`` is built: requests admitted here reach it with
        neutral per-request settings, cancellations reach the sampler, its steps pass ``NativeStepSampler``."""
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

        if not isinstance(manager, ContinuousBatchingManager):
            return  # an engine process's stand-in: the engine's own NativeRequestSampling starts there
        self.worker_limit = _replays_sampling(manager.continuous_batching_config)
        add_request, cancel_request = manager.add_request, manager.cancel_request

        def add(input_ids: Any, request_id: str | None = None, *args: Any, **kwargs: Any) -> Any:
            if request_id is not None and self.neutral and self.has(request_id):
                kwargs = {**self.neutral, **kwargs}
            return add_request(input_ids, request_id, *args, **kwargs)

        def cancel(request_id: str) -> None:
            self.step_sampler.cancel(request_id)
            cancel_request(request_id)

        manager.add_request, manager.cancel_request = add, cancel  # on the instance: its class is untouched
        install_native_sampler(self.step_sampler)


def worker_processors(model: Any) -> tuple[tuple[str, ...], set[str]]:
    """``(fixed, keys)`` of the processors transformers' worker builds from ``model.generation_config``
    (as ``ContinuousBatchingManager`` does, per-request versions on): the names of those it applies
    to every row alike, and the per-request keys it takes."""
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
        ContinuousBatchingLogitsProcessorList,
    )

    processors = ContinuousBatchingLogitsProcessorList(
        model._get_logits_processor(model.generation_config), per_request_processors=True
    )
    fixed = tuple(type(processor).__name__ for processor in processors.logits_processor
                  if not isinstance(processor, ContinuousBatchingLogitsProcessor))
    return fixed, set(processors.supported_keys)


def _replays_sampling(config: Any) -> str | None:
    graphs = config.use_cuda_graph
    if graphs is True or (isinstance(graphs, (tuple, list)) and any(graphs)):
        return "transformers' CUDA graphs of its step replay the sampling they captured"
    if config.varlen_compile_config is not None or config.decode_compile_config is not None:
        return "transformers' torch.compile of its step compiles the sampling in"
    return None
