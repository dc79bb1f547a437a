"""``RequestSampling``: each request's ``SamplingParams``, from the HTTP handler to the batching worker.

transformers' serving handlers submit a request to continuous batching with its prompt,
``max_new_tokens`` and EOS ids only. With the kvplug cache, ``kvplug serve`` parses a request's
sampling fields (``sampling_fields.request_params``), registers them here under the server's
request id, and the worker's ``BatchSampler`` takes them at the request's first sampled step. The
worker itself starts greedy with no logits processors (``config``), so transformers hands
kvplug's sampler raw logits and applies nothing of its own.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable

from kvplug.interface import InvalidArgumentError

from kvplug_transformers.sampling_params import SamplingParams, checkpoint_defaults
from kvplug_transformers.worker_watch import WorkerSampling

# GenerationConfig fields that make transformers add a logits processor to every request
# (``model._get_logits_processor``): neutral in the worker's config, kvplug's sampler does their work
PROCESSOR_FIELDS = {
    "do_sample": False, "temperature": None, "top_p": None, "top_k": None, "min_p": None, "typical_p": None,
    "epsilon_cutoff": None, "eta_cutoff": None, "repetition_penalty": None, "encoder_repetition_penalty": None,
    "no_repeat_ngram_size": None, "bad_words_ids": None, "sequence_bias": None, "min_length": None,
    "min_new_tokens": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "stop_strings": None, "num_beams": 1, "num_return_sequences": 1,
    "renormalize_logits": False, "watermarking_config": None,
}


class RequestSampling(WorkerSampling):
    """Sampling settings by request id (thread-safe: handlers register, the worker takes).

    Args:
        generation_config: the checkpoint's (``model.generation_config``): the defaults.
        vocab_size: the model's vocabulary (``logit_bias`` keys are checked against it).
        decode: token ids to text (the tokenizer's, special tokens skipped) for ``stop`` strings;
            ``None``: no request may have any.
    """

    def __init__(self, generation_config: Any, vocab_size: int,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.defaults: SamplingParams = checkpoint_defaults(generation_config)
        self.vocab_size = vocab_size
        self.decode = decode
        self._params: dict[str, SamplingParams] = {}
        self._lock = threading.Lock()
        self._config: Any = None

    def register(self, request_id: str, params: SamplingParams) -> None:
        if params.stop and self.decode is None:
            raise InvalidArgumentError(
                f"request {request_id} has stop strings {list(params.stop)!r}, but this RequestSampling has no "
                "decode function to find them with"
            )
        with self._lock:
            self._params[request_id] = params

    def take(self, request_id: str) -> SamplingParams:
        """A request's settings, forgotten here (the sampler keeps them); the defaults for a request
        that registered none (transformers' warm-up, a library caller)."""
        with self._lock:
            return self._params.pop(request_id, self.defaults)

    def admit(self, params: SamplingParams) -> SamplingParams | None:
        """What a checked request's ``params`` register as (``None``: nothing): every request's, here."""
        return params

    def has(self, request_id: str) -> bool:
        """Whether the request registered settings the worker has not taken yet."""
        with self._lock:
            return request_id in self._params

    def stops(self, request_id: str) -> tuple[str, ...]:
        """A registered request's stop strings (before the worker took its settings)."""
        with self._lock:
            params = self._params.get(request_id)
        return () if params is None else params.stop

    def discard(self, request_id: str) -> None:
        """A request that will never reach the worker (refused, failed before submission)."""
        with self._lock:
            self._params.pop(request_id, None)

    @property
    def any_waiting(self) -> bool:
        """``waiting > 0`` without the lock (a dict's size is read atomically): the per-step check of
        ``NativeStepSampler``. A request registers before it is submitted, so its first step sees it."""
        return bool(self._params)

    @property
    def waiting(self) -> int:
        """Registered requests the worker has not sampled yet."""
        with self._lock:
            return len(self._params)

    def config(self, model: Any) -> Any:
        """The worker's generation config: the checkpoint's, greedy and without any processor."""
        if self._config is None:
            config = copy.deepcopy(model.generation_config)
            for name, neutral in PROCESSOR_FIELDS.items():
                if hasattr(config, name):
                    setattr(config, name, neutral)
            config.use_cache = False  # continuous batching manages its own paged cache
            self._config = config
        return self._config

    def check(self, model: Any, requested: Any) -> None:
        """Nothing to refuse: every request's sampling is its own."""
