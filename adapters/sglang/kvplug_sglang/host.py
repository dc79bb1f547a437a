"""``kvplug`` host ``"sglang"``: what ``PluginManager().create("host", "sglang", ...)`` returns.

SGLang loads the plugin by itself through its entry point; this object is for code that drives
SGLang from Python: ``install()`` does what SGLang's plugin loader does (for a process where the
entry point is not installed or ``SGLANG_PLUGINS`` excludes it), and ``cli_args()`` /
``engine_kwargs()`` spell the chosen kvplug components for ``sglang serve`` and ``sglang.Engine``.
"""

from __future__ import annotations

from typing import Any, Callable

from kvplug.memory.capacity import parse_memory_size
from kvplug.plugins import PluginManager, default_manager

from kvplug_sglang import compat, names
from kvplug_sglang import remote_kv as _remote_kv


class SGLangHost:
    """kvplug inside SGLang, with prefix cache ``prefix_cache`` and kvplug attention ``attention``,
    and a host-memory tier of ``host_memory`` (bytes or ``"32GiB"``; ``None``: none) under the cache,
    and a shared KV store ``remote_kv`` (a URL, e.g. ``redis://:PASSWORD@HOST:6379/0``) under that tier.

    Raises:
        kvplug.UnknownComponentError: an unknown prefix-cache or attention name.
        kvplug.InvalidArgumentError: a malformed ``host_memory``; a ``remote_kv`` without a host tier
            or over a cache other than ``radix`` (the password shown as ``***@``).
    """

    name = "sglang"
    supported_versions = compat.SUPPORTED_VERSIONS

    def __init__(
        self,
        prefix_cache: str = names.DEFAULT_PREFIX_CACHE,
        attention: str = names.DEFAULT_ATTENTION,
        manager: Callable[[], PluginManager] = default_manager,
        host_memory: int | str | None = None,
        remote_kv: str | None = None,
    ) -> None:
        manager().registry.get("prefix_cache", prefix_cache)
        self.host_memory = None if host_memory is None else parse_memory_size(host_memory)
        if remote_kv is not None:
            _remote_kv.check(remote_kv, prefix_cache, self.host_memory)
        self.remote_kv = remote_kv
        for part in attention.split(","):
            if part.strip() != names.DEFAULT_ATTENTION:
                manager().registry.get("attention", part.strip())
        self.prefix_cache = prefix_cache
        self.attention = attention

    def install(self) -> bool:
        """Register kvplug's components and hooks in this SGLang process and apply the hooks; with
        ``remote_kv``, hand its URL to the SGLang processes this one starts (``sglang.Engine``), as
        ``--kvplug-remote-kv`` does: in this process's environment, never in ``ServerArgs``."""
        from kvplug_sglang.sglang_plugin import register

        if not register():
            return False
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()
        _remote_kv.publish(self.remote_kv)
        return True

    def __repr__(self) -> str:  # the URL may hold a password
        shown = None if self.remote_kv is None else _remote_kv.shown(self.remote_kv)
        return (f"SGLangHost(prefix_cache={self.prefix_cache!r}, attention={self.attention!r}, "
                f"host_memory={self.host_memory!r}, remote_kv={shown!r})")

    def cli_args(self) -> list[str]:
        """Arguments for ``sglang serve`` / ``python -m sglang.launch_server``."""
        args = ["--kv-backend", "kvplug", "--prefix-cache", self.prefix_cache, "--kvplug-attention", self.attention]
        if self.host_memory is not None:
            args += ["--kvplug-host-memory", str(self.host_memory)]
        return args if self.remote_kv is None else [*args, _remote_kv.FLAG, self.remote_kv]

    def engine_kwargs(self) -> dict[str, Any]:
        """SGLang ``ServerArgs`` fields (``sglang.Engine(**kwargs)``) with the same effect as ``cli_args()``
        (``remote_kv`` is no field: ``install()`` hands it over)."""
        return {
            "radix_cache_backend": names.radix_cache_backend_name(self.prefix_cache, self.host_memory),
            "attention_backend": names.attention_backend_name(self.attention),
            # decode graphs stay SGLang's ("full" on CUDA: kvplug's graph hooks); prefill graphs are not wired
            "cuda_graph_backend_prefill": "disabled",
        }
