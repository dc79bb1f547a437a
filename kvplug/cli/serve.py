"""``kvplug serve``: an OpenAI-compatible server (transformers' own) whose KV cache is kvplug.

Examples::

    kvplug serve                                   # the embedded default model, radix cache
    kvplug serve --model ./Qwen3-0.6B --prefix-cache radix --attention auto --port 8000
    kvplug serve --model ./Qwen3-0.6B --kv-backend native      # transformers' own paged cache

Without ``--model`` it serves the embedded default: a small Qwen3-shaped model with random weights
and a byte-level tokenizer, built offline and cached on disk; its output text is meaningless.
Cache statistics (hit tokens, evictions, utilisation) are logged and served at
``GET /kvplug/stats``. Ctrl-C or SIGTERM stops it cleanly (exit code 0).

This module never imports transformers: the server lives in the ``transformers`` host plugin
(``pip install ./adapters/transformers``), found through the plugin manager. Arguments that can be
checked without it (paths, sizes, component names) are checked here, before anything loads.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from kvplug.interface import InvalidArgumentError, KVPlugError, UnknownComponentError
from kvplug.memory.capacity import parse_memory_size
from kvplug.memory.model_shape import parse_dtype
from kvplug.plugins import PluginManager

HOST_NAME = "transformers"
INSTALL_HINT = "pip install ./adapters/transformers (or: pip install kvplug-transformers)"
_FRACTION = re.compile(r"^\s*([0-9]+\.[0-9]*|\.[0-9]+|[0-9]*\.?[0-9]+%)\s*$")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible API with kvplug as its KV cache",
        description=(
            "Start transformers' OpenAI-compatible server (continuous batching) with kvplug's KV pool, "
            "allocator, prefix cache and attention installed. Without --model, serves the embedded default "
            "model (random weights, offline byte-level tokenizer: its text output is meaningless)."
        ),
    )
    parser.add_argument("--model", help="local Hugging Face checkpoint directory (default: the embedded model)")
    parser.add_argument(
        "--kv-backend",
        choices=("kvplug", "native"),
        default="kvplug",
        help="kvplug (default) or native: transformers' own paged cache, for comparison",
    )
    parser.add_argument("--prefix-cache", default="radix", help="prefix cache by name (default radix)")
    parser.add_argument("--attention", default="auto", help="attention backend by name or 'P,D' (default auto)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument("--max-running-reqs", type=int, default=64, help="requests running at once (default 64)")
    parser.add_argument(
        "--kv-memory",
        help="KV pool budget: bytes ('2GiB', '512MiB', '1000000') or a fraction of free memory ('0.5', '50%%')",
    )
    parser.add_argument("--max-seq-len", type=int, help="longest request in tokens (default: the model's context)")
    parser.add_argument("--max-batch-tokens", type=int, help="tokens per forward step (default: 2048 CPU, 8192 CUDA)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (default auto)")
    parser.add_argument("--dtype", default="auto", help="model and KV dtype: auto, bfloat16, float16, float32")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error (default info)")
    parser.add_argument(
        "--stats-interval", type=float, default=10.0, help="seconds between cache-statistics log lines (0: off)"
    )
    parser.set_defaults(handler=run)


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
        if not 0.0 < fraction <= 1.0:
            raise InvalidArgumentError(f"--kv-memory as a fraction must lie in (0, 1], got {text!r}")
        return fraction
    return parse_memory_size(text)


def validate(args: argparse.Namespace, manager: PluginManager) -> dict[str, Any]:
    """Check every argument that needs no model or transformers; return the host's keyword options."""
    for name in ("page_size", "max_running_reqs", "port"):
        value = getattr(args, name)
        if value < 1 or (name == "port" and value > 65535):
            flag = "--" + name.replace("_", "-")
            raise InvalidArgumentError(f"{flag} must be a positive int (port <= 65535), got {value}")
    for name in ("max_seq_len", "max_batch_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be a positive int, got {value}")
    if args.dtype != "auto":
        parse_dtype(args.dtype)
    model = None
    if args.model is not None:
        model = os.path.abspath(os.path.expanduser(args.model))
        if not os.path.isdir(model):
            raise InvalidArgumentError(
                f"--model must be a local Hugging Face checkpoint directory; {args.model!r} does not exist "
                "or is not a directory (downloads are not supported: download it first)"
            )
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise InvalidArgumentError(f"--model {args.model!r} has no config.json: not a Hugging Face checkpoint")
    if args.kv_backend == "kvplug":
        _check_names(manager, "prefix_cache", [args.prefix_cache], "--prefix-cache")
        if args.attention != "auto":
            _check_names(manager, "attention", [part.strip() for part in args.attention.split(",")], "--attention")
    return {
        "model": model,
        "kv_backend": args.kv_backend,
        "prefix_cache": args.prefix_cache,
        "attention": args.attention,
        "page_size": args.page_size,
        "max_running_reqs": args.max_running_reqs,
        "kv_memory": parse_kv_memory(args.kv_memory),
        "max_seq_len": args.max_seq_len,
        "max_batch_tokens": args.max_batch_tokens,
        "device": args.device,
        "dtype": args.dtype,
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "stats_interval": args.stats_interval,
    }


def _check_names(manager: PluginManager, kind: str, names: list[str], flag: str) -> None:
    available = manager.available(kind)
    for name in names:
        if name not in available:
            providers = manager.providers(kind)
            listing = ", ".join(f"{known!r} (from {providers[known]})" for known in available) or "none"
            raise UnknownComponentError(f"{flag}: unknown {kind} {name!r}; available: {listing}")


def find_host(manager: PluginManager) -> Any:
    """The transformers host adapter, or a clear error naming how to install it."""
    if HOST_NAME not in manager.available("host"):
        failures = [f for f in manager.load_failures if f.entry_point == HOST_NAME]
        reason = f" (its plugin failed to load: {failures[0].error})" if failures else ""
        raise KVPlugError(
            f"kvplug serve needs the '{HOST_NAME}' host plugin, which is not installed{reason}: {INSTALL_HINT}"
        )
    return manager.create("host", HOST_NAME)


def run(args: argparse.Namespace) -> int:
    manager = PluginManager()
    options = validate(args, manager)
    host = find_host(manager)
    return int(host.serve(**options) or 0)
