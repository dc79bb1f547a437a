"""``kvplug capacity``: how many tokens, pages and requests a KV memory budget holds.

Examples::

    kvplug capacity path/to/Qwen3-0.6B --memory 40GiB --context-len 4096
    kvplug capacity --layers 28 --kv-heads 8 --head-dim 128 --memory 512MiB --json

The model comes from a local HF ``config.json`` (a model directory or the file), or from
``--layers/--kv-heads/--head-dim``; flags given together with a config override its fields.
The budget is per tensor-parallel rank. JSON output is ``CapacityPlan.to_json()`` plus a
``model`` object. The page size defaults to ``kvplug serve``'s (16 tokens).
"""

from __future__ import annotations

import argparse
import json
import re

from kvplug.cli._defaults import DEFAULT_PAGE_SIZE
from kvplug.interface import InvalidArgumentError
from kvplug.memory.capacity import CapacityPlan, plan_capacity
from kvplug.cli._config_file import read_config
from kvplug.cli._sizes import parse_size
from kvplug.memory.model_config import KVGeometry, dtype_name, read_hf_config
from kvplug.memory.tensor_parallel import local_kv_heads


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "capacity", help="KV bytes per token and the tokens, pages and requests a memory budget holds"
    )
    parser.add_argument("model", nargs="?", help="local model directory or config.json (HF format)")
    parser.add_argument("--layers", type=int, help="attention layers (overrides the config)")
    parser.add_argument("--kv-heads", type=int, help="global KV heads (overrides the config)")
    parser.add_argument("--q-heads", type=int, help="query heads (default: the config's, else --kv-heads)")
    parser.add_argument("--head-dim", type=int, help="elements per head (overrides the config)")
    parser.add_argument("--memory", required=True, help="KV budget per rank: bytes or e.g. 40GiB, 512MiB, 1.5GB")
    parser.add_argument("--dtype", help="KV dtype: bf16, fp16, fp32 (default: the config's, else bf16)")
    parser.add_argument(
        "--page-size",
        type=int,
        default=DEFAULT_PAGE_SIZE,
        help=f"tokens per page (default {DEFAULT_PAGE_SIZE}, as kvplug serve)",
    )
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument("--context-len", type=int, help="request length for the concurrency estimate")
    parser.add_argument(
        "--host-memory", help="a host-memory tier under the prefix cache (as kvplug serve --host-memory): e.g. 64GiB"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run)


def model_shape(args: argparse.Namespace) -> KVGeometry:
    """The geometry from ``args.model`` and/or the explicit flags (no torch: see ``model_config``)."""
    dtype = dtype_name(args.dtype) if args.dtype else None
    overrides = {"num_layers": args.layers, "num_kv_heads": args.kv_heads, "head_dim": args.head_dim}
    if args.model:
        base = read_hf_config(read_config(args.model), dtype=dtype)
        return _geometry(
            _given(args.layers, base.num_layers), _given(args.q_heads, base.num_qo_heads),
            _given(args.kv_heads, base.num_kv_heads), _given(args.head_dim, base.head_dim), base.dtype,
        )
    missing = [f"--{name.replace('num_', '').replace('_', '-')}" for name, value in overrides.items() if value is None]
    if missing:
        raise InvalidArgumentError(
            f"give a model config path, or all of --layers, --kv-heads and --head-dim (missing: {', '.join(missing)})"
        )
    return _geometry(args.layers, _given(args.q_heads, args.kv_heads), args.kv_heads, args.head_dim, dtype or "bfloat16")


def _given(flag_value: int | None, default: int) -> int:
    """A flag's value when given (0 included: refused by ``_geometry``), else the default."""
    return default if flag_value is None else flag_value


def _geometry(layers: int, q_heads: int, kv_heads: int, head_dim: int, dtype: str) -> KVGeometry:
    """A checked ``KVGeometry`` (the checks ``ModelShape`` makes)."""
    for flag, value in (("--layers", layers), ("--q-heads", q_heads), ("--kv-heads", kv_heads), ("--head-dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{flag} must be a positive int, got {value!r}")
    if q_heads % kv_heads:
        raise InvalidArgumentError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    return KVGeometry(layers, q_heads, kv_heads, head_dim, dtype)


def run(args: argparse.Namespace) -> int:
    shape = model_shape(args)
    if re.fullmatch(r"\s*([0-9]*\.[0-9]+|[0-9]+\.[0-9]*|[0-9.]+%)\s*", args.memory):
        raise InvalidArgumentError(
            f"--memory is a budget in bytes ('40GiB', '512MiB'), got the fraction {args.memory!r}: capacity looks at "
            "no device, so it cannot take a fraction of free memory (kvplug serve --kv-memory can); give "
            "the bytes that fraction is on your device"
        )
    memory = parse_size("--memory", args.memory)
    host_memory = None if args.host_memory is None else parse_size("--host-memory", args.host_memory)
    plan = plan_capacity(
        shape, memory, page_size=args.page_size, tp_size=args.tp_size, context_len=args.context_len,
        host_memory=host_memory,
    )
    if args.json:
        model = {
            "num_layers": shape.num_layers,
            "num_qo_heads": shape.num_qo_heads,
            "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "dtype": shape.dtype,
            "tp_size": args.tp_size,
        }
        print(json.dumps({"model": model, **plan.to_json()}, indent=2))
        return 0
    print(describe(shape, plan, args.tp_size))
    return 0


def describe(shape: KVGeometry, plan: CapacityPlan, tp_size: int) -> str:
    dtype = shape.dtype
    lines = [
        f"model: {shape.num_layers} layers, {shape.num_qo_heads} query heads, {shape.num_kv_heads} KV heads, "
        f"head_dim {shape.head_dim}, {dtype}; tp_size {tp_size} -> {local_kv_heads(shape.num_kv_heads, tp_size)} "
        "KV heads per rank",
        f"KV bytes per token: {plan.bytes_per_token:,} ({_human(plan.bytes_per_token)})",
        f"memory budget per rank: {plan.memory_budget:,} bytes ({_human(plan.memory_budget)})",
        f"pages that fit: {plan.num_pages:,} of {plan.page_size} token(s) (one more page is the dummy page)",
        f"tokens that fit: {plan.num_tokens:,}",
        f"pool size: {plan.pool_bytes:,} bytes ({_human(plan.pool_bytes)})",
    ]
    if plan.host_memory is not None:
        lines.append(
            f"host-memory tier: {plan.host_memory:,} bytes ({_human(plan.host_memory)}) hold {plan.host_pages:,} pages = "
            f"{plan.host_tokens:,} tokens; prefix cache over both tiers: {plan.cached_tokens:,} tokens"
        )
    if plan.context_len is not None:
        lines.append(f"concurrent requests at {plan.context_len:,} tokens: {plan.concurrent_requests:,}")
    return "\n".join(lines)


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{size} B"
        value /= 1024
    return f"{value:.1f} TiB"
