"""The messages between ``kvplug serve``'s HTTP process and its engine process (``--engine-process``).

One pipe (``multiprocessing`` connection, pickled tuples) each way. The frontend sends requests
to add (with their ``SamplingParams``: the engine's sampler applies them) or cancel, statistics queries and the stop; the engine answers with one ``STEP`` message
per batch of outputs carrying every request's *new* token ids (the frontend detokenises), as
vLLM v1's engine core does. Plain tuples: one message per step is the hot path.

With ``--api-server-count N`` the engine has one such pipe per API server process
(``engine_links``): each frontend's ids are its own, ``READY`` / ``FATAL`` / ``STOPPED`` go to
all, a ``STOP`` from any frontend but the first only detaches that one (its requests cancelled,
``STOPPED`` then its pipe closed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

# frontend -> engine
ADD = "add"  # (ADD, request_id, input_ids, max_new_tokens, eos_token_id, streaming, SamplingParams | None)
CANCEL = "cancel"  # (CANCEL, request_id)
STATS = "stats"  # (STATS, query_id)
STOP = "stop"  # (STOP, seconds the worker may take to stop)
# engine -> frontend
READY = "ready"  # (READY, pid)
STEP = "step"  # (STEP, [StepOutput, ...])
FATAL = "fatal"  # (FATAL, "Type: message"): the batching worker died; the engine exits after it
STATS_REPLY = "stats_reply"  # (STATS_REPLY, query_id, HostStats | dict | None)
STOPPED = "stopped"  # (STOPPED, last HostStats | None)


class StepOutput(NamedTuple):
    """One request's progress in one engine step: the token ids generated since the last message."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    error: str | None


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process needs to build what ``kvplug serve`` would build in-process.

    Attributes:
        model_path: the checkpoint directory.
        device, dtype_name, trust_remote_code: transformers' ``ModelManager`` arguments.
        cb_kwargs: ``ContinuousBatchingConfig`` fields (native backend sizing), may be empty.
        kvplug_settings: the ``KVPlugSettings`` to install, ``None`` for ``--kv-backend native``.
        generation_config: the worker's generation config (``ServerSampling``'s, or with
            ``per_request_sampling`` ``RequestSampling.config``'s: greedy, no logits processor).
        per_request_sampling: the engine's kvplug cache samples each request with the
            ``SamplingParams`` its ``ADD`` carries, as the in-process server does.
        seed: ``--seed``.
        log_level, uvicorn_log_level, log_requests: the server's logging options.
        stream_interval: a streamed request's new tokens are sent once this many have come (its
            first token and its end at once): ``--stream-interval``.
    """

    model_path: str
    device: str
    dtype_name: str
    trust_remote_code: bool
    cb_kwargs: dict
    kvplug_settings: Any
    generation_config: Any
    seed: int | None
    log_level: str
    uvicorn_log_level: str | None
    log_requests: bool
    per_request_sampling: bool = False
    stream_interval: int = 1
