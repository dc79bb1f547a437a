"""``--kv-backend``, ``--prefix-cache``, ``--kvplug-attention``, ``--kvplug-host-memory`` and
``--kvplug-on-cache-failure`` on SGLang's server parser.

``add_kvplug_arguments(parser)`` runs right after ``ServerArgs.add_cli_args(parser)``: it adds the
four arguments and wraps that parser's ``parse_known_args`` (which ``parse_args`` calls), so the
parsed namespace is checked as a whole and translated into SGLang's own fields before
``ServerArgs.from_cli_args`` reads it (see ``names.py`` for the translation). Conflicting flags are
rejected through ``parser.error``: exit status 2 with the usage line, like any argparse error.

``--kvplug-host-memory SIZE`` (bytes or ``32GiB``-style) needs ``--kv-backend kvplug`` (the tier
copies pages of kvplug's KV pool) and a prefix cache that has a host tier (it is asked: one is
built with the option ``host_memory`` and must be a ``BaseTieredPrefixCache``); it travels in
``--radix-cache-backend kvplug:NAME+host_memory=BYTES``.

``--kvplug-remote-kv URL`` (issue 30; needs ``--kvplug-host-memory`` and the radix cache) puts a
shared KV store under the host tier; the URL may hold a password, so it travels in an environment
variable of the server's own processes, never in ``ServerArgs`` (``remote_kv``).

``--kvplug-on-cache-failure {fallback,fail}`` (needs ``--kv-backend kvplug``) says what happens
when an untrusted prefix-cache plugin raises or answers outside the contract (``quarantine``):
``fallback`` (default) quarantines it and ``naive`` takes over, ``fail`` stops the scheduler with
the fault; it travels as ``+on_cache_failure=fail`` in ``--radix-cache-backend`` (``names``).

Name checks ask kvplug's plugin manager, so third-party prefix caches and attention backends
installed as kvplug plugins are accepted, and an unknown name is rejected with the list of
available names and the plugin that provides each.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from kvplug.interface import BaseTieredPrefixCache, KVPlugError, UnknownComponentError
from kvplug.memory.capacity import parse_memory_size
from kvplug.plugins import PluginManager, default_manager

from kvplug_sglang import names, remote_kv

KV_BACKENDS = ("native", "kvplug")
# SGLang fields that --kv-backend kvplug sets; the user may set them only to the same value
_ATTENTION_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
# SGLang's graph backends per phase that kvplug attention supports: decode graphs captured whole
# ("full", SGLang's default on CUDA; kvplug's decode graph hooks) or none; prefill graphs none
# (SGLang's CUDA default, "breakable", is replaced by "disabled" when the user chose nothing)
_CUDA_GRAPH_SUPPORTED = {"decode": ("full", "disabled"), "prefill": ("disabled",)}
_CUDA_GRAPH_UNSET_DEFAULT = {"prefill": "disabled"}


def _name_checker(kind: str, manager: Callable[[], PluginManager], extra: tuple[str, ...] = ()) -> Callable[[str], str]:
    def check(value: str) -> str:
        parts = [part.strip() for part in value.split(",")] if kind == "attention" else [value]
        if kind == "attention" and len(parts) > 2:
            raise argparse.ArgumentTypeError(f"expected NAME or 'PREFILL,DECODE', got {value!r}")
        for part in parts:
            if part in extra:
                continue
            try:
                manager().registry.get(kind, part)
            except UnknownComponentError as error:
                raise argparse.ArgumentTypeError(str(error)) from None
        return ",".join(parts)

    check.__name__ = f"kvplug {kind} name"
    return check


def add_kvplug_arguments(
    parser: argparse.ArgumentParser, manager: Callable[[], PluginManager] = default_manager
) -> None:
    """Add kvplug's arguments to SGLang's server ``parser`` and install the namespace translation."""
    group = parser.add_argument_group("kvplug", "Run SGLang's KV cache on kvplug (kvplug-sglang plugin).")
    group.add_argument(
        "--kv-backend",
        choices=KV_BACKENDS,
        default="native",
        help="'kvplug' runs the KV pool, req-to-token table, prefix cache and attention on kvplug; "
        "'native' (default) leaves SGLang's own.",
    )
    group.add_argument(
        "--prefix-cache",
        type=_name_checker("prefix_cache", manager),
        default=None,
        metavar="NAME",
        help=f"kvplug prefix cache by name (default {names.DEFAULT_PREFIX_CACHE!r}); any cache a kvplug plugin "
        "registers. Needs --kv-backend kvplug.",
    )
    group.add_argument(
        "--kvplug-attention",
        type=_name_checker("attention", manager, extra=(names.DEFAULT_ATTENTION,)),
        default=None,
        metavar="NAME",
        help="kvplug attention backend: auto (default), torch, triton, flashinfer, fa3 or 'PREFILL,DECODE'. "
        "Needs --kv-backend kvplug.",
    )
    group.add_argument(
        "--kvplug-host-memory",
        type=_memory_size,
        default=None,
        metavar="SIZE",
        help="A host-memory tier under the kvplug prefix cache: evicted prefixes are written back to SIZE "
        "of (pinned) host memory, e.g. 32GiB, and loaded back when a request is admitted with them. "
        "Needs --kv-backend kvplug and a prefix cache with a host tier (radix).",
    )
    group.add_argument(
        remote_kv.FLAG,
        default=None,
        metavar="URL",
        help="A KV store shared by servers under the host-memory tier, e.g. redis://:PASSWORD@HOST:6379/0: "
        "evicted prefixes are written to it and prompts missing the host tier are looked up there. Keys "
        "name the served model (--served-model-name). Needs --kvplug-host-memory and the radix prefix cache.",
    )
    group.add_argument(
        "--kvplug-on-cache-failure",
        choices=names.ON_CACHE_FAILURE_CHOICES,
        default=None,
        help="When an untrusted kvplug prefix-cache plugin raises or answers outside the contract: "
        "'fallback' (default) quarantines it (its pages go back to the pool, running requests keep "
        "their prefixes) and kvplug's 'naive' cache takes over; 'fail' stops the server with the fault. "
        "Needs --kv-backend kvplug.",
    )
    original = parser.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None):
        parsed, extras = original(args, namespace)
        problem = translate_namespace(parsed, parser, manager)
        if problem:
            parser.error(problem)
        if getattr(parsed, "kvplug_remote_kv", None) is not None:
            import sys

            remote_kv.redact_argv(args)  # the list SGLang keeps as ServerArgs.launch_command
            remote_kv.redact_argv(sys.argv)
        return parsed, extras

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _memory_size(value: str) -> int:
    try:
        return parse_memory_size(value)
    except KVPlugError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_memory_size.__name__ = "memory size"


def _host_tier_problem(prefix_cache: str, host_memory: int, manager: Callable[[], PluginManager]) -> str:
    """Why kvplug prefix cache ``prefix_cache`` cannot have a host tier, or ``""``."""
    try:
        cache = manager().create_prefix_cache(prefix_cache, device="cpu", page_size=1, host_memory=host_memory)
    except KVPlugError as error:
        return f"--kvplug-host-memory: kvplug prefix cache {prefix_cache!r} takes no host_memory option ({error})"
    if not isinstance(cache, BaseTieredPrefixCache):
        return (
            f"--kvplug-host-memory: kvplug prefix cache {prefix_cache!r} has no host-memory tier "
            f"(it builds a {type(cache).__name__}); use --prefix-cache radix"
        )
    return ""


def translate_namespace(
    ns: argparse.Namespace,
    parser: Optional[argparse.ArgumentParser] = None,
    manager: Callable[[], PluginManager] = default_manager,
) -> str:
    """Write ``--kv-backend kvplug``'s choices into SGLang's fields of ``ns``; return an error message
    for conflicting flags (``""`` when there is none). ``ns`` is unchanged when there is a conflict."""
    kv_backend = getattr(ns, "kv_backend", "native")
    prefix_cache = getattr(ns, "prefix_cache", None)
    attention = getattr(ns, "kvplug_attention", None)
    host_memory = getattr(ns, "kvplug_host_memory", None)
    on_cache_failure = getattr(ns, "kvplug_on_cache_failure", None)
    store_url = getattr(ns, "kvplug_remote_kv", None)
    if kv_backend != "kvplug":
        if store_url is not None:
            return (
                f"{remote_kv.FLAG} {remote_kv.shown(store_url)} needs --kv-backend kvplug and --kvplug-host-memory: "
                "the store sits under kvplug's host tier"
            )
        if host_memory is not None:
            return (
                "--kvplug-host-memory needs --kv-backend kvplug: the host tier copies pages of kvplug's KV pool "
                "(--radix-cache-backend kvplug:NAME alone keeps SGLang's own pools and has no host tier)"
            )
        given = [
            flag
            for flag, value in (
                ("--prefix-cache", prefix_cache),
                ("--kvplug-attention", attention),
                ("--kvplug-on-cache-failure", on_cache_failure),
            )
            if value
        ]
        if given:
            return (
                f"{' and '.join(given)} select kvplug components: add --kv-backend kvplug "
                "(or use --radix-cache-backend kvplug:NAME for a kvplug prefix cache with SGLang's own pools)"
            )
        return ""
    if host_memory is not None:
        if getattr(ns, "enable_hierarchical_cache", False):
            return "--kvplug-host-memory is kvplug's host tier; SGLang's --enable-hierarchical-cache cannot run under it"
        if getattr(ns, "disable_radix_cache", False):
            return "--kvplug-host-memory keeps evicted prefixes for later requests; it needs the prefix cache: drop --disable-radix-cache"
        problem = _host_tier_problem(prefix_cache or names.DEFAULT_PREFIX_CACHE, host_memory, manager)
        if problem:
            return problem
    if store_url is not None:
        try:
            remote_kv.check(store_url, prefix_cache or names.DEFAULT_PREFIX_CACHE, host_memory)
        except KVPlugError as error:
            return f"{remote_kv.FLAG}: {error}"
    radix_backend = names.radix_cache_backend_name(prefix_cache or names.DEFAULT_PREFIX_CACHE, host_memory, on_cache_failure)
    attention_backend = names.attention_backend_name(attention or names.DEFAULT_ATTENTION)
    current = getattr(ns, "radix_cache_backend", None)
    if current not in (None, radix_backend, names.radix_cache_backend_name(prefix_cache or names.DEFAULT_PREFIX_CACHE)):
        return f"--kv-backend kvplug uses --radix-cache-backend {radix_backend}; got --radix-cache-backend {current}"
    for field in _ATTENTION_FIELDS:
        value = getattr(ns, field, None)
        if value is not None and value != attention_backend:
            flag = "--" + field.replace("_", "-")
            return (
                f"--kv-backend kvplug runs kvplug attention ({flag} {attention_backend}); got {flag} {value}. "
                "Choose the kvplug attention backend with --kvplug-attention NAME"
            )
    problem = _cuda_graph_problem(ns)
    if problem:
        return problem
    ns.radix_cache_backend = radix_backend
    ns.attention_backend = attention_backend
    remote_kv.publish(store_url)
    if store_url is not None:
        ns.kvplug_remote_kv = remote_kv.shown(store_url)  # the namespace may be printed; the URL is published
    for phase, value in _CUDA_GRAPH_UNSET_DEFAULT.items():
        field = f"cuda_graph_backend_{phase}"
        if hasattr(ns, field) and getattr(ns, field) is None:
            setattr(ns, field, _parsed_value(parser, field, value))
    return ""


def _cuda_graph_problem(ns: argparse.Namespace) -> str:
    """Why ``ns``'s CUDA-graph choices cannot run with kvplug attention, or ``""``."""
    for phase, supported in _CUDA_GRAPH_SUPPORTED.items():
        flag = f"--cuda-graph-backend-{phase}"
        choices = [(flag, getattr(ns, f"cuda_graph_backend_{phase}", None))]
        config = getattr(ns, "cuda_graph_config", None)
        if isinstance(config, dict) and isinstance(config.get(phase), dict):  # the JSON form, which wins
            choices.append((f"--cuda-graph-config {phase}.backend", config[phase].get("backend")))
        for where, value in choices:
            if value is not None and str(value) not in supported:
                what = "decode graphs captured whole" if phase == "decode" else "no prefill graphs"
                return (
                    f"--kv-backend kvplug supports {what} ({flag} {' or '.join(supported)}); got {where} {value}"
                )
    return ""


def _parsed_value(parser: Optional[argparse.ArgumentParser], dest: str, text: str) -> Any:
    """``text`` as the parser's own ``type=`` for ``dest`` would have converted it."""
    for action in getattr(parser, "_actions", ()):
        if action.dest == dest and callable(action.type):
            return action.type(text)
    return text
