"""``kvplug serve``: an OpenAI-compatible server (transformers' own) whose KV cache is kvplug.

Examples::

    kvplug serve                                   # the embedded default model, radix cache
    kvplug serve ./Qwen3-0.6B --prefix-cache radix --attention auto --port 8000
    kvplug serve ./Qwen3-0.6B --kv-backend native  # transformers' own paged cache

Without a model it serves the embedded default: a small Qwen3-shaped model with random weights
and a byte-level tokenizer, built offline and cached on disk; its output text is meaningless.
Cache statistics (hit tokens, evictions, utilisation) are logged and served at
``GET /kvplug/stats``. Ctrl-C or SIGTERM stops it cleanly (exit code 0) within
``--shutdown-timeout`` seconds.

This module never imports transformers: the server lives in the ``transformers`` host plugin
(``pip install ./adapters/transformers``), found through the plugin manager. Arguments that can be
checked without it (paths, sizes, component names, which flags apply to which backend, the port)
are checked here, before anything loads.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import socket
from typing import Any

from kvplug.cli._defaults import DEFAULT_PAGE_SIZE
from kvplug.cli._config_file import read_config
from kvplug.cli._sizes import parse_size
from kvplug.interface import InvalidArgumentError, KVPlugError, UnknownComponentError
from kvplug.memory.model_shape import parse_dtype
from kvplug.plugins import PluginManager
from kvplug.plugins.loading import PluginSelection, kvplug_entry_points

HOST_NAME = "transformers"
INSTALL_HINT = "pip install -e ./adapters/transformers (from the root of the kvplug repository)"
_FRACTION = re.compile(r"^\s*([0-9]+\.[0-9]*|\.[0-9]+|[0-9]*\.?[0-9]+%)\s*$")

DEFAULTS = {
    "kv_backend": "kvplug",
    "prefix_cache": "radix",
    "attention": "auto",
    "page_size": DEFAULT_PAGE_SIZE,
    "max_running_reqs": 64,
    "stats_interval": 10.0,
}
# flags that only configure kvplug: an error with --kv-backend native, which would ignore them
KVPLUG_ONLY_FLAGS = ("prefix_cache", "attention", "max_running_reqs", "stats_interval", "cuda_graph_max_bs",
                     "disable_cuda_graph", "disable_overlap_schedule", "enable_torch_compile", "host_memory",
                     "on_cache_failure", "kv_events_config", "remote_kv")
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# vLLM / SGLang spellings of kvplug serve's own flags: (alias, the flag it stands for, whose flag)
VALUE_ALIASES = (
    ("--max-num-seqs", "--max-running-reqs", "vLLM"),
    ("--max-running-requests", "--max-running-reqs", "SGLang"),
    ("--max-num-batched-tokens", "--max-batch-tokens", "vLLM"),
    ("--block-size", "--page-size", "vLLM"),
    ("--mem-fraction-static", "--gpu-memory-utilization", "SGLang"),
)
# one line each in --help, after the aliases above
ALIAS_NOTES = (
    ("--disable-radix-cache", "= --prefix-cache naive (SGLang)"),
    ("--enable-prefix-caching", "= --prefix-cache radix, the default; --no-enable-prefix-caching = naive (vLLM)"),
    ("--tokenizer PATH", "accepted when PATH is the model's folder (its tokenizer is always the one used)"),
    ("--trust-remote-code", "passed to transformers when it loads the config and the model"),
    ("--seed N", "seeds torch at start (sampling reproducible across runs)"),
    ("--kv-cache-dtype auto", "accepted; fp8 and other KV dtypes refused: the pool stores K/V in the model's dtype"),
    ("--disable-log-requests", "drops transformers' per-request log line"),
    ("--uvicorn-log-level L", "uvicorn's loggers only (--log-level sets every logger)"),
    ("--tensor-parallel-size/--tp/--tp-size 1", "accepted; more is refused: kvplug serve runs on one device"),
    ("--chat-template", "refused: the checkpoint's template is used (send one per request with "
     "--trust-request-chat-template)"),
)

COMPONENT_DESCRIPTIONS = {
    ("prefix_cache", "radix"): "a radix tree of cached prompt prefixes shared across requests; LRU eviction",
    ("prefix_cache", "naive"): "caches nothing: every prompt is computed in full (a baseline to compare with)",
    ("attention", "auto"): "torch on CPU; on CUDA flashinfer if it imports, else triton, else torch (never fa3: name it)",
    ("attention", "torch"): "reference PyTorch kernels (CPU and CUDA)",
    ("attention", "triton"): "Triton kernels (CUDA)",
    ("attention", "flashinfer"): "FlashInfer kernels (CUDA; needs the flashinfer package)",
    ("attention", "fa3"): "sgl-kernel's FlashAttention 3 paged kernel (Hopper GPUs; needs the sglang-kernel wheel: pip install -e '.[fa3]')",
}


class _ServeParser(argparse.ArgumentParser):
    """The ``serve`` parser: a flag it does not know is reported with the ``serve`` usage (the
    top-level parser would print its own), and ``--help`` lists the components registered now."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def format_help(self) -> str:
        return super().format_help() + "\n" + aliases_help() + "\n\n" + components_help() + "\n"


def aliases_help() -> str:
    """The vLLM / SGLang flags ``kvplug serve`` takes, one line each."""
    lines = ["vLLM / SGLang flags (one line each):"]
    lines += [f"  {alias:<40} = {target} ({whose})" for alias, target, whose in VALUE_ALIASES]
    lines += [f"  {alias:<40} {note}" for alias, note in ALIAS_NOTES]
    return "\n".join(lines)


def components_help() -> str:
    """One line per registered prefix cache and attention backend, with where it comes from."""
    try:
        manager = PluginManager()
    except Exception as error:  # the help must print even when a plugin is broken
        return f"(cannot list components: {type(error).__name__}: {error})\n"
    sections = []
    for kind, flag in (("prefix_cache", "--prefix-cache"), ("attention", "--attention")):
        providers = manager.providers(kind)
        lines = [f"{flag} choices (registered now):"]
        for name in manager.available(kind):
            description = COMPONENT_DESCRIPTIONS.get((kind, name), f"from the plugin {providers.get(name, '?')}")
            lines.append(f"  {name:<12} {description}")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser_class = subparsers._parser_class
    subparsers._parser_class = _ServeParser
    try:
        parser = subparsers.add_parser(
            "serve",
            help="serve a model over an OpenAI-compatible API with kvplug as its KV cache",
            description=(
                "Start transformers' OpenAI-compatible server (continuous batching) with kvplug's KV pool, "
                "allocator, prefix cache and attention installed. Without MODEL, serves the embedded default "
                "model (random weights, offline byte-level tokenizer: its text output is meaningless). "
                "Flags that vLLM and SGLang users know are accepted where they mean the same thing."
            ),
        )
    finally:
        subparsers._parser_class = parser_class
    _add_arguments(parser)
    parser.set_defaults(handler=run)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_positional", nargs="?", metavar="MODEL",
        help="local Hugging Face checkpoint directory (default: the embedded model)",
    )
    parser.add_argument("--model", "--model-path", dest="model", help="same as MODEL (--model-path: SGLang's name)")
    parser.add_argument(
        "--served-model-name",
        help="the model id clients use and GET /v1/models lists (default: the checkpoint folder's name, or "
        "'kvplug-default' for the embedded model); requests may also omit it",
    )
    parser.add_argument(
        "--kv-backend", choices=("kvplug", "native"), default=None,
        help="kvplug (default) or native: transformers' own paged cache, for comparison",
    )
    parser.add_argument("--prefix-cache", help="prefix cache by name (default radix; choices listed below)")
    parser.add_argument("--attention", help="attention backend by name or 'P,D' for prefill,decode (default auto)")
    parser.add_argument("--page-size", type=int, help="tokens per KV page, >= 1 (native: >= 4) (default 16)")
    parser.add_argument("--max-running-reqs", type=int, help="requests holding KV at once (default 64)")
    parser.add_argument(
        "--kv-memory",
        help="KV pool budget: bytes ('2GiB', '512MiB', '1000000') or a fraction of free memory ('0.5', '50%%')",
    )
    parser.add_argument(
        "--host-memory", metavar="SIZE",
        help="a host-memory tier under the prefix cache (radix, or a plugin's tiered cache): pinned host memory ('32GiB', '512MiB') that keeps "
        "prefixes evicted from the KV pool and loads them back on a hit (default: none)",
    )
    parser.add_argument(  # issue 30
        "--remote-kv", metavar="URL",
        help="a KV store shared by servers, under the host-memory tier (needs --host-memory): "
        "'redis://[:PASSWORD@]HOST:PORT/DB'; prefixes this server evicts are written there, and prompts whose "
        "prefix neither tier holds are looked up there",
    )
    parser.add_argument(  # issue 32
        "--on-cache-failure", choices=("fallback", "fail"),
        help="when a third-party prefix cache raises or answers outside the contract: 'fallback' (default) hands "
        "its pages back and serves on with the naive cache; 'fail' stops the server",
    )
    parser.add_argument(  # issue 27
        "--kv-events-config", metavar="JSON",
        help="publish the prefix cache's KV events for cache-aware routers (NVIDIA Dynamo, vllm-router) in vLLM's "
        "and SGLang's ZMQ format, with their keys: '{\"publisher\": \"zmq\", \"endpoint\": "
        "\"tcp://127.0.0.1:5557\", \"replay_endpoint\": \"tcp://127.0.0.1:5558\", \"topic\": \"\"}' "
        "(also bind, buffer_steps, hwm, max_queue_size; default: none)",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, metavar="FRACTION",
        help="vLLM's flag, here the KV pool's fraction of free device memory: same as --kv-memory FRACTION",
    )
    parser.add_argument(
        "--max-seq-len", "--max-model-len", "--context-length", dest="max_seq_len", type=int,
        help="longest request (prompt + completion) in tokens, at most the model's context (default: the "
        "model's context); longer prompts are refused with 400, completions stop there (finish_reason length)",
    )
    parser.add_argument("--max-batch-tokens", type=int, help="tokens per forward step (default: 2048 CPU, 8192 CUDA)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (default auto)")
    parser.add_argument(
        "--dtype", default="auto", help="model and KV dtype: auto, bfloat16, float16 (half), float32 (float)"
    )
    for alias, target, _ in VALUE_ALIASES:  # listed in one table at the end of --help
        value_type = float if target == "--gpu-memory-utilization" else int
        parser.add_argument(alias, dest=_alias_dest(alias), type=value_type, help=argparse.SUPPRESS)
    parser.add_argument("--disable-radix-cache", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--trust-remote-code", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chat-template", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kv-cache-dtype", help=argparse.SUPPRESS)
    parser.add_argument("--disable-log-requests", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--uvicorn-log-level", choices=("critical", "error", "warning", "info", "debug", "trace"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--tensor-parallel-size", "--tp", "--tp-size", dest="tensor_parallel_size", type=int,
                        help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    parser.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on every route but /health (401 otherwise)"
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"),
        help="for every logger: kvplug's, transformers' and uvicorn's (default info)",
    )
    parser.add_argument(
        "--stats-interval", type=float, help="seconds between cache-statistics log lines (0: off; default 10)"
    )
    parser.add_argument(
        "--cuda-graph-max-bs", type=int, metavar="N",
        help="on CUDA, decode steps of up to N requests replay from kvplug's CUDA graphs, captured before "
        "/health says ready at 1, 2, 4, 8, then steps of 8 up to N (SGLang's flag; default --max-running-reqs)",
    )
    parser.add_argument(
        "--disable-cuda-graph", action="store_true", default=None,
        help="run every decode step eagerly (SGLang's flag; kvplug's CUDA graphs are on by default on CUDA)",
    )
    parser.add_argument(
        "--enable-torch-compile", action="store_true", default=None,
        help="torch.compile the model before kvplug captures its decode graphs (fused norms, rotary and "
        "activations in every replay; compiling adds start-up time; SGLang's flag)",
    )
    parser.add_argument(
        "--disable-overlap-schedule", action="store_true", default=None,
        help="wait for each step's outputs before scheduling the next (SGLang's flag; by default on CUDA the "
        "next step is scheduled while the current one runs: transformers' async batching)",
    )
    parser.add_argument(
        "--engine-process", action="store_true",
        help="run the model, the batching worker and kvplug in a process of their own, the HTTP server and "
        "every client's token stream in this one (vLLM v1's engine core): streaming clients no longer "
        "take the interpreter from the batching worker",
    )
    parser.add_argument(
        "--stream-interval", type=int, default=1, metavar="N",
        help="with --engine-process: a stream gets its tokens N at a time (the first at once, the last with the "
        "end), as vLLM's and SGLang's --stream-interval; text and usage are the same (default 1: every token)",
    )
    parser.add_argument(
        "--api-server-count", type=int, default=1, metavar="N",
        help="N HTTP processes share the port over one engine process, each detokenising its own requests "
        "(vLLM's --api-server-count; N > 1 implies --engine-process; default 1)",
    )
    parser.add_argument(
        "--shutdown-timeout", type=float, default=10.0,
        help="seconds from SIGTERM / Ctrl-C to exit: running requests may finish, then are aborted (default 10)",
    )
    parser.add_argument(
        "--max-request-bytes", default="4MiB",
        help="largest request body, bytes or a size ('4MiB'); 413 above (default 4MiB)",
    )
    parser.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="let requests bring their own Jinja chat template (chat_template_kwargs.chat_template; vLLM's flag); "
        "refused with 400 otherwise",
    )
    parser.add_argument(
        "--limit-concurrency", type=int, metavar="N",
        help="open connections at once (uvicorn's flag); one more gets a 503 and is closed (default: what the "
        "file-descriptor limit leaves, at most 4096)",
    )
    parser.add_argument(
        "--timeout-keep-alive", type=float, default=5.0, metavar="S",
        help="close an idle keep-alive connection after S seconds (uvicorn's flag; default 5)",
    )
    parser.add_argument(
        "--timeout-header", type=float, default=10.0, metavar="S",
        help="a request's line and headers must arrive within S seconds, else 408 and close (default 10)",
    )
    parser.add_argument(
        "--timeout-body", type=float, default=30.0, metavar="S",
        help="a request's body must arrive within S seconds, else 408 and close (default 30)",
    )
    parser.add_argument(
        "--stream-stall-timeout", type=float, default=30.0, metavar="S",
        help="a client that reads nothing of its response for S seconds, or does not keep up with it (once "
        "16 KiB of its output waits unsent, that backlog must drain completely within S seconds; partial "
        "reads do not restart the clock), is cut off and its request aborted (its KV row freed; default 30)",
    )


def parse_kv_memory(text: str | None) -> int | float | None:
    """``None``, bytes (int) or a fraction of free memory in ``(0, 1]`` (float).

    A value with a decimal point and no unit ('0.5', '1.0') or a percentage ('50%') is a fraction;
    an integer or a size with a unit ('1000000', '512MiB', '2GB') is bytes.
    """
    if text is None:
        return None
    if _FRACTION.match(text):
        stripped = text.strip()
        fraction = float(stripped[:-1]) / 100 if stripped.endswith("%") else float(stripped)
        if not (math.isfinite(fraction) and 0.0 < fraction <= 1.0):
            raise InvalidArgumentError(f"--kv-memory as a fraction must lie in (0, 1], got {text!r}")
        return fraction
    return parse_size("--kv-memory", text)


def _alias_dest(flag: str) -> str:
    return "alias_" + flag.lstrip("-").replace("-", "_")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _apply_aliases(args: argparse.Namespace) -> None:
    """Fold the vLLM / SGLang flags into kvplug serve's own (``VALUE_ALIASES``, ``ALIAS_NOTES``);
    two spellings of one setting with different values are an error, and so is an alias that
    cannot apply here (with the reason)."""
    for alias, target, whose in VALUE_ALIASES:
        value = getattr(args, _alias_dest(alias), None)
        if value is None:
            continue
        current = getattr(args, _dest(target), None)
        if current is not None and current != value:
            raise InvalidArgumentError(f"{alias} {value} ({whose}'s name for {target}) and {target} {current} disagree")
        setattr(args, _dest(target), value)
    caches = []
    if getattr(args, "disable_radix_cache", False):
        caches.append(("--disable-radix-cache", "naive"))
    enable = getattr(args, "enable_prefix_caching", None)
    if enable is not None:
        caches.append(("--enable-prefix-caching" if enable else "--no-enable-prefix-caching",
                       "radix" if enable else "naive"))
    for flag, cache in caches:
        if args.prefix_cache is not None and args.prefix_cache != cache:
            raise InvalidArgumentError(f"{flag} means --prefix-cache {cache}, but --prefix-cache is {args.prefix_cache!r}")
        args.prefix_cache = cache
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None and tp != 1:
        raise InvalidArgumentError(
            f"--tensor-parallel-size {tp}: kvplug serve runs the model on one device (transformers' continuous "
            "batching here has no tensor parallelism); give 1 or leave it out"
        )
    kv_cache_dtype = getattr(args, "kv_cache_dtype", None)
    if kv_cache_dtype is not None and kv_cache_dtype != "auto":
        raise InvalidArgumentError(
            f"--kv-cache-dtype {kv_cache_dtype!r}: kvplug's KV pool stores K/V in the model's dtype (--dtype); "
            "only 'auto' applies"
        )
    if getattr(args, "chat_template", None) is not None:
        raise InvalidArgumentError(
            "--chat-template: kvplug serve uses the checkpoint's chat template (tokenizer_config.json or "
            "chat_template.jinja next to config.json); put yours there, or send it per request with "
            "--trust-request-chat-template"
        )


def validate(args: argparse.Namespace, manager: PluginManager) -> dict[str, Any]:
    """Check every argument that needs no model or transformers; return the host's keyword options."""
    _apply_aliases(args)
    given = {name for name in (*DEFAULTS, *KVPLUG_ONLY_FLAGS) if getattr(args, name, None) is not None}
    for name, value in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    # a flag with no effect here is accepted, dropped and named in a start-up warning (never an
    # error): one command line then serves both sides of an A/B (--kv-backend kvplug / native, CUDA / CPU)
    ignored: list[str] = []
    if args.kv_backend == "native":
        named = [f"--{name.replace('_', '-')}" for name in KVPLUG_ONLY_FLAGS if name in given]
        if named:
            verb = "configures" if len(named) == 1 else "configure"
            ignored.append(f"{', '.join(named)} {verb} kvplug's cache: ignored with --kv-backend native "
                           "(transformers' own cache)")
            for name in KVPLUG_ONLY_FLAGS:
                setattr(args, name, DEFAULTS.get(name))
    _check_int("--page-size", args.page_size, low=1)
    _check_int("--max-running-reqs", args.max_running_reqs, low=1)
    _check_int("--port", args.port, low=1, high=65535)
    if args.cuda_graph_max_bs is not None:
        _check_int("--cuda-graph-max-bs", args.cuda_graph_max_bs, low=1, high=args.max_running_reqs)
        if args.disable_cuda_graph and args.kv_backend == "kvplug":
            ignored.append("--cuda-graph-max-bs sizes kvplug's CUDA graphs: ignored with --disable-cuda-graph")
            args.cuda_graph_max_bs = None
    if args.enable_torch_compile and args.disable_cuda_graph and args.kv_backend == "kvplug":
        ignored.append("--enable-torch-compile compiles the model kvplug captures in its CUDA graphs: ignored with "
                       "--disable-cuda-graph")
        args.enable_torch_compile = None
    for flag, value in (("--max-seq-len", args.max_seq_len), ("--max-batch-tokens", args.max_batch_tokens)):
        if value is not None:
            _check_int(flag, value, low=2 if flag == "--max-seq-len" else 1)
    if not (math.isfinite(args.stats_interval) and args.stats_interval >= 0):
        raise InvalidArgumentError(f"--stats-interval must be >= 0 seconds (0: off), got {args.stats_interval:g}")
    for flag, value in (
        ("--shutdown-timeout", args.shutdown_timeout), ("--timeout-keep-alive", args.timeout_keep_alive),
        ("--timeout-header", args.timeout_header), ("--timeout-body", args.timeout_body),
        ("--stream-stall-timeout", args.stream_stall_timeout),
    ):
        if not (math.isfinite(value) and 0 < value <= 3600):
            raise InvalidArgumentError(f"{flag} must be seconds in (0, 3600], got {value:g}")
    if args.limit_concurrency is not None:
        _check_int("--limit-concurrency", args.limit_concurrency, low=1)
    if args.gpu_memory_utilization is not None and not math.isfinite(args.gpu_memory_utilization):
        raise InvalidArgumentError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {args.gpu_memory_utilization:g}")
    dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)
    if dtype != "auto":
        try:
            parse_dtype(dtype)
        except KVPlugError as error:
            raise InvalidArgumentError(
                f"--dtype must be auto, bfloat16, float16 or float32, got {args.dtype!r}"
            ) from error
    model = _model_path(args)
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer is not None:
        same = model is not None and os.path.abspath(os.path.expanduser(tokenizer)) == model
        if not same:
            raise InvalidArgumentError(
                f"--tokenizer {tokenizer!r}: kvplug serve uses the tokenizer next to the model's config.json "
                f"({model or 'the embedded model'}); a tokenizer from elsewhere is not supported"
            )
    kv_memory = parse_kv_memory(args.kv_memory)
    if args.gpu_memory_utilization is not None:
        if kv_memory is not None:
            raise InvalidArgumentError(
                "give --kv-memory or --gpu-memory-utilization, not both (they set the same budget)"
            )
        if not 0.0 < args.gpu_memory_utilization <= 1.0:
            raise InvalidArgumentError(
                f"--gpu-memory-utilization must be a fraction in (0, 1], got {args.gpu_memory_utilization:g}"
            )
        kv_memory = float(args.gpu_memory_utilization)
    max_request_bytes = parse_size("--max-request-bytes", args.max_request_bytes)
    host_memory = None
    if args.host_memory is not None:
        host_memory = parse_size("--host-memory", args.host_memory)
    remote_kv = getattr(args, "remote_kv", None)
    if remote_kv is not None:  # issue 30: checked here, connected at the first lookup
        from kvplug.interface import KVStoreConfig

        store = KVStoreConfig(remote_kv)  # a URL without '://' is refused, without its password
        if host_memory is None:
            raise InvalidArgumentError(
                f"--remote-kv sits under the host-memory tier: give --host-memory too (got --remote-kv {store.redacted_url})"
            )
        if args.prefix_cache != "radix":
            raise InvalidArgumentError(
                f"--remote-kv is read and written by the radix cache's host tier; --prefix-cache is {args.prefix_cache!r}"
            )
        _check_names(manager, "kv_store", [store.scheme], "--remote-kv (its URL scheme)")
    kv_events = None
    if args.kv_events_config is not None:  # issue 27
        from kvplug.events.config import parse_kv_events_config

        kv_events = parse_kv_events_config(args.kv_events_config)
    if args.kv_backend == "kvplug":
        _check_names(manager, "prefix_cache", [args.prefix_cache], "--prefix-cache")
        if host_memory is not None:
            _check_host_tier(manager, args.prefix_cache, host_memory)
        if args.attention != "auto":
            _check_names(manager, "attention", [part.strip() for part in args.attention.split(",")], "--attention")
    return {
        "model": model,
        "kv_backend": args.kv_backend,
        "prefix_cache": args.prefix_cache,
        "attention": args.attention,
        "page_size": args.page_size,
        "max_running_reqs": args.max_running_reqs,
        "kv_memory": kv_memory,
        "max_seq_len": args.max_seq_len,
        "max_batch_tokens": args.max_batch_tokens,
        "device": args.device,
        "dtype": dtype,
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "stats_interval": args.stats_interval,
        "served_model_name": args.served_model_name,
        "api_key": args.api_key,
        "shutdown_timeout": args.shutdown_timeout,
        "max_request_bytes": max_request_bytes,
        "cuda_graphs": False if args.disable_cuda_graph else None,
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
        "overlap_schedule": False if args.disable_overlap_schedule else None,
        "torch_compile": bool(args.enable_torch_compile),
        "host_memory": host_memory,
        "remote_kv": remote_kv,
        "trust_request_chat_template": bool(args.trust_request_chat_template),
        "limit_concurrency": args.limit_concurrency,
        "timeout_keep_alive": args.timeout_keep_alive,
        "timeout_header": args.timeout_header,
        "timeout_body": args.timeout_body,
        "stream_stall_timeout": args.stream_stall_timeout,
        "on_cache_failure": args.on_cache_failure or "fallback",  # issue 32
        "kv_events": kv_events,  # issue 27
        "ignored_flags": tuple(ignored),
        "trust_remote_code": bool(getattr(args, "trust_remote_code", False)),
        "seed": getattr(args, "seed", None),
        "log_requests": not getattr(args, "disable_log_requests", False),
        "uvicorn_log_level": getattr(args, "uvicorn_log_level", None),
        # --api-server-count N > 1 runs the engine in its own process (vLLM's engine core)
        "engine_process": bool(getattr(args, "engine_process", False)) or getattr(args, "api_server_count", 1) > 1,
        "api_server_count": getattr(args, "api_server_count", 1),
        "stream_interval": getattr(args, "stream_interval", 1),
    }


def _model_path(args: argparse.Namespace) -> str | None:
    positional, flag = args.model_positional, args.model
    if positional is not None and flag is not None and positional != flag:
        raise InvalidArgumentError(f"MODEL {positional!r} and --model {flag!r} disagree: give the model once")
    given = positional if positional is not None else flag
    if given is None:
        return None
    model = os.path.abspath(os.path.expanduser(given))
    if not os.path.isdir(model):
        raise InvalidArgumentError(
            f"MODEL must be a local Hugging Face checkpoint directory; {given!r} does not exist "
            "or is not a directory (downloads are not supported: download it first)"
        )
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise InvalidArgumentError(f"MODEL {given!r} has no config.json: not a Hugging Face checkpoint")
    read_config(model)  # bounded, readable, valid JSON: transformers then reads it without surprises
    return model


def _check_int(flag: str, value: int, *, low: int, high: int | None = None) -> None:
    if value < low or (high is not None and value > high):
        rule = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
        raise InvalidArgumentError(f"{flag} must be {rule}, got {value}")


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on now, before the model loads (seconds saved)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise InvalidArgumentError(f"--host {host!r} is not an address of this machine: {error}") from error
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise KVPlugError(f"port {port} on {host} is already in use (--port)") from error
            raise KVPlugError(f"cannot listen on {host}:{port}: {error.strerror or error}") from error


def _check_names(manager: PluginManager, kind: str, names: list[str], flag: str) -> None:
    available = manager.available(kind)
    for name in names:
        if name not in available:
            providers = manager.providers(kind)
            listing = ", ".join(f"{known!r} (from {providers[known]})" for known in available) or "none"
            raise UnknownComponentError(f"{flag}: unknown {kind} {name!r}; available: {listing}")


def _check_host_tier(manager: PluginManager, prefix_cache: str, host_memory: int) -> None:
    """``--host-memory`` needs a prefix cache with a host tier: ``radix``, or a plugin whose cache
    built with the option ``host_memory`` is a ``BaseTieredPrefixCache`` (it is asked, as SGLang's
    ``--kvplug-host-memory`` asks it: a cache allocates its host memory only once attached to a pool)."""
    if prefix_cache == "radix":
        return
    from kvplug.interface import BaseTieredPrefixCache

    try:
        cache = manager.create_prefix_cache(prefix_cache, device="cpu", page_size=1, host_memory=host_memory)
    except KVPlugError as error:
        raise InvalidArgumentError(
            f"--host-memory: prefix cache {prefix_cache!r} takes no host_memory option ({error})"
        ) from error
    if not isinstance(cache, BaseTieredPrefixCache):
        raise InvalidArgumentError(
            f"--host-memory is a host-memory tier under the prefix cache; prefix cache {prefix_cache!r} has none "
            f"(it builds a {type(cache).__name__}, not a BaseTieredPrefixCache): use the tier of the radix prefix "
            "cache (--prefix-cache radix) or a plugin's tiered cache"
        )


def find_host(manager: PluginManager) -> Any:
    """The transformers host adapter, or a clear error naming how to install it."""
    if HOST_NAME not in manager.available("host"):
        failures = [f for f in manager.load_failures if f.entry_point == HOST_NAME]
        if failures:
            raise KVPlugError(
                f"kvplug serve needs the '{HOST_NAME}' host plugin, which failed to load: {failures[0].error}"
            )
        selection = PluginSelection.from_env(os.environ)
        if any(ep.name == HOST_NAME for ep in kvplug_entry_points()) and not selection.wants(HOST_NAME):
            if HOST_NAME in selection.block:
                why = f"KVPLUG_DISABLE_PLUGINS={os.environ.get('KVPLUG_DISABLE_PLUGINS')!r} names it: remove it there"
            else:
                why = (f"KVPLUG_LOAD_PLUGINS={os.environ.get('KVPLUG_LOAD_PLUGINS')!r} does not name it: "
                       f"add '{HOST_NAME}' there or unset it")
            raise KVPlugError(
                f"kvplug serve needs the '{HOST_NAME}' host plugin, which is installed but not loaded: {why}"
            )
        raise KVPlugError(f"kvplug serve needs the '{HOST_NAME}' host plugin, which is not installed: {INSTALL_HINT}")
    return manager.create("host", HOST_NAME)


def run(args: argparse.Namespace) -> int:
    manager = PluginManager()
    options = validate(args, manager)
    check_port_free(options["host"], options["port"])
    host = find_host(manager)
    return int(host.serve(**options) or 0)
