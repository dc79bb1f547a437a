"""``ServeOptions``: the arguments of ``kvplug serve`` as the host receives them, and their
translation for the native (transformers-only) comparison run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from kvplug.interface import InvalidArgumentError
from kvplug.memory.model_shape import ModelShape

from kvplug_transformers.planning import CPU_DEFAULT_BUDGET, CPU_DEFAULT_FRACTION, DEFAULT_BATCH_TOKENS, free_memory

NATIVE_MIN_BLOCK_SIZE = 4  # transformers' PagedAttentionCache refuses smaller blocks
EMBEDDED_MODEL_NAME = "kvplug-default"
DEFAULT_SHUTDOWN_TIMEOUT = 10.0  # seconds from SIGTERM to exit, in-flight requests included
MAX_SHUTDOWN_TIMEOUT = 3600.0
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a request body; text prompts of ~1 M tokens fit
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0  # uvicorn's default: an idle keep-alive connection is closed after it
DEFAULT_TIMEOUT_HEADER = 10.0  # a request's line and headers must arrive within it
DEFAULT_TIMEOUT_BODY = 30.0  # a request's body must arrive within it
DEFAULT_STREAM_STALL_TIMEOUT = 30.0  # a client reading nothing for this long, or whose full backlog takes longer to drain, is cut off
DESCRIPTOR_RESERVE = 128  # file descriptors kept for the model, logs and the process besides connections
ACCEPT_BACKLOG = 64  # connections the event loop may accept in one go (each a descriptor before it is counted)
MAX_TIMEOUT = 3600.0
MAX_STREAM_INTERVAL = 1024  # tokens a stream may be sent at a time (--stream-interval)
MAX_API_SERVERS = 64  # --api-server-count: HTTP processes over one engine process


@dataclass(frozen=True)
class ServeOptions:
    """See ``kvplug serve --help``; ``model=None`` means the embedded default model."""

    model: str | None = None
    kv_backend: str = "kvplug"
    prefix_cache: str = "radix"
    attention: str = "auto"
    page_size: int = 16
    max_running_reqs: int = 64
    kv_memory: int | float | None = None
    max_seq_len: int | None = None
    max_batch_tokens: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    stats_interval: float = 10.0
    served_model_name: str | None = None
    api_key: str | None = None
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    cuda_graphs: bool | None = None
    cuda_graph_max_bs: int | None = None
    overlap_schedule: bool | None = None
    torch_compile: bool = False
    host_memory: int | None = None
    remote_kv: str | None = field(default=None, repr=False)  # issue 30; may hold a password
    trust_request_chat_template: bool = False
    limit_concurrency: int | None = None
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE
    timeout_header: float = DEFAULT_TIMEOUT_HEADER
    timeout_body: float = DEFAULT_TIMEOUT_BODY
    stream_stall_timeout: float = DEFAULT_STREAM_STALL_TIMEOUT
    on_cache_failure: str = "fallback"  # issue 32: kvplug.cache_guard's policy
    kv_events: Any = None  # issue 27: a kvplug.events.KVEventsConfig (--kv-events-config), None: no events
    ignored_flags: tuple[str, ...] = ()  # flags with no effect here, each with why: logged as a warning at start
    trust_remote_code: bool = False  # vLLM's --trust-remote-code: transformers may run the checkpoint's code
    seed: int | None = None  # torch's seed at start
    log_requests: bool = True  # False: --disable-log-requests drops transformers' per-request line
    uvicorn_log_level: str | None = None  # uvicorn's loggers only (None: --log-level)
    engine_process: bool = False  # issue 28: model and batching worker in their own process
    stream_interval: int = 1  # issue 28: streamed tokens sent N at a time by the engine process (1: each)
    api_server_count: int = 1  # issue 28: HTTP processes sharing the port over one engine process


    def __post_init__(self) -> None:
        for flag, value in (
            ("--timeout-keep-alive", self.timeout_keep_alive), ("--timeout-header", self.timeout_header),
            ("--timeout-body", self.timeout_body), ("--stream-stall-timeout", self.stream_stall_timeout),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT:
                raise InvalidArgumentError(f"{flag} must be seconds in (0, {MAX_TIMEOUT:g}], got {value!r}")
        interval = self.stats_interval
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval <= MAX_TIMEOUT:
            raise InvalidArgumentError(
                f"--stats-interval must be seconds in [0, {MAX_TIMEOUT:g}] (0: off), got {self.stats_interval!r}"
            )
        limit = self.limit_concurrency
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise InvalidArgumentError(f"--limit-concurrency must be an int >= 1, got {limit!r}")
        if self.kv_backend not in ("kvplug", "native"):
            raise InvalidArgumentError(f"kv_backend must be 'kvplug' or 'native', got {self.kv_backend!r}")
        if not (isinstance(self.shutdown_timeout, (int, float)) and 0 < self.shutdown_timeout <= MAX_SHUTDOWN_TIMEOUT):
            raise InvalidArgumentError(
                f"--shutdown-timeout must be seconds in (0, {MAX_SHUTDOWN_TIMEOUT:g}], got {self.shutdown_timeout!r}"
            )
        size = self.max_request_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1024:
            raise InvalidArgumentError(f"--max-request-bytes must be an int >= 1024, got {self.max_request_bytes!r}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise InvalidArgumentError("--served-model-name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise InvalidArgumentError("--api-key must not be empty")
        count = self.api_server_count
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_API_SERVERS:
            raise InvalidArgumentError(f"--api-server-count must be an int in [1, {MAX_API_SERVERS}], got {count!r}")
        if count > 1 and not self.engine_process:
            raise InvalidArgumentError(
                f"--api-server-count {count} needs the engine in its own process: add --engine-process "
                "(the CLI implies it)")
        if self.engine_process and self.kv_events is not None and self.kv_events.enabled:
            # NOTE: the caches publishing the events live in the engine process; the publisher is not built there yet
            raise InvalidArgumentError("--kv-events-config does not work with --engine-process yet (--api-server-count > 1 "
                                       "runs one): drop one of them")
        interval = self.stream_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= MAX_STREAM_INTERVAL:
            raise InvalidArgumentError(
                f"--stream-interval must be an int in [1, {MAX_STREAM_INTERVAL}], got {self.stream_interval!r}")
        if interval > 1 and not self.engine_process:
            raise InvalidArgumentError(
                f"--stream-interval {interval} needs --engine-process (its engine sends the tokens N at a time); "
                "add --engine-process or drop --stream-interval")

    def connection_limit(self) -> int:
        """``--limit-concurrency``, or what the process's file-descriptor limit leaves for
        connections (``DESCRIPTOR_RESERVE`` kept for everything else, and ``ACCEPT_BACKLOG`` for
        connections accepted but not yet counted)."""
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        reserve = DESCRIPTOR_RESERVE + ACCEPT_BACKLOG
        room = None if soft == resource.RLIM_INFINITY else max(soft - reserve, 8)
        if self.limit_concurrency is None:
            return min(room, 4096) if room is not None else 4096
        if room is not None and self.limit_concurrency > room:
            raise InvalidArgumentError(
                f"--limit-concurrency {self.limit_concurrency} needs more file descriptors than this process may open "
                f"(ulimit -n {soft}, {reserve} of them kept for the rest): give at most {room}"
            )
        return self.limit_concurrency

    def model_name(self, model_path: str) -> str:
        """The id clients name the model by: ``--served-model-name``, else the checkpoint folder's
        name, else (the embedded model) ``kvplug-default``."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return EMBEDDED_MODEL_NAME
        return os.path.basename(os.path.normpath(model_path)) or model_path

    def no_effect_on(self, device: torch.device) -> tuple[str, ...]:
        """``ignored_flags`` and the CUDA-only flags given for a CPU run: each a warning at start."""
        notes = list(self.ignored_flags)
        if device.type != "cuda" and self.kv_backend == "kvplug":
            cuda_only = [flag for flag, given in (
                ("--cuda-graph-max-bs", self.cuda_graph_max_bs is not None),
                ("--disable-cuda-graph", self.cuda_graphs is False),
                ("--enable-torch-compile", self.torch_compile),
                ("--disable-overlap-schedule", self.overlap_schedule is False),
            ) if given]
            if cuda_only:
                notes.append(f"{', '.join(cuda_only)}: CUDA only (graphs, compile and overlap), ignored on {device}")
        return tuple(notes)

    def kvplug_settings(self) -> dict[str, Any]:
        """The ``KVPlugSettings`` fields these options set."""
        return {
            "prefix_cache": self.prefix_cache,
            "attention": self.attention,
            "page_size": self.page_size,
            "max_running_reqs": self.max_running_reqs,
            "kv_memory": self.kv_memory,
            "max_seq_len": self.max_seq_len,
            "max_batch_tokens": self.max_batch_tokens,
            "cuda_graphs": self.cuda_graphs,
            "cuda_graph_max_bs": self.cuda_graph_max_bs,
            "overlap_schedule": self.overlap_schedule,
            "torch_compile": self.torch_compile,
            "host_memory": self.host_memory,
            "remote_kv": self.remote_kv,  # issue 30: keys namespaced by the served model's id
            "remote_kv_model": self.model_name(self.model or "") if self.remote_kv else None,
            "backend_options": {"on_cache_failure": self.on_cache_failure},  # issue 32
        }


def native_cb_options(opts: ServeOptions, shape: ModelShape, context_len: int) -> dict[str, Any]:
    """``transformers.cli.serve.Serve`` keyword arguments sizing transformers' own cache like kvplug's.

    The page size becomes the block size; a byte budget becomes a block count; a fraction
    becomes ``max_memory_percent``; the step size is kvplug's default unless given. On CPU without
    ``--kv-memory`` the budget is kvplug's CPU default (transformers would otherwise take most of
    the RAM).
    """
    if opts.page_size < NATIVE_MIN_BLOCK_SIZE:
        raise InvalidArgumentError(
            f"--kv-backend native needs --page-size >= {NATIVE_MIN_BLOCK_SIZE} (transformers' minimum block size), "
            f"got {opts.page_size}"
        )
    on_cpu = opts.device == "cpu" or (opts.device == "auto" and not torch.cuda.is_available())
    # transformers would size the step from free memory, and its eager/sdpa paged path allocates a
    # [step, pool + step] mask: take kvplug's default step size instead
    batch_tokens = opts.max_batch_tokens or DEFAULT_BATCH_TOKENS["cpu" if on_cpu else "cuda"]
    options: dict[str, Any] = {"cb_block_size": opts.page_size, "cb_max_batch_tokens": batch_tokens}
    budget = opts.kv_memory
    if budget is None and on_cpu:
        budget = min(CPU_DEFAULT_BUDGET, int(free_memory(torch.device("cpu")) * CPU_DEFAULT_FRACTION))
    if isinstance(budget, float):
        options["cb_max_memory_percent"] = budget
    elif isinstance(budget, int):
        block_bytes = opts.page_size * shape.kv_bytes_per_token()
        num_blocks = budget // block_bytes
        max_seq_len = opts.max_seq_len or context_len
        if num_blocks * opts.page_size < max_seq_len:
            raise InvalidArgumentError(
                f"the KV pool is too small for one request: {budget:,} bytes hold {num_blocks * opts.page_size:,} "
                f"tokens ({num_blocks:,} blocks of {opts.page_size}, {block_bytes:,} bytes each) but one request may "
                f"need max_seq_len={max_seq_len:,} tokens; raise --kv-memory or lower --max-seq-len"
            )
        options["cb_num_blocks"] = num_blocks
    return options
