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


class SGLangHost:
    """kvplug inside SGLang, with prefix cache ``prefix_cache`` and kvplug attention ``attention``,
    and a host-memory tier of ``host_memory`` (bytes or ``"32GiB"``; ``None``: none) under the cache.

    Raises:
        kvplug.UnknownComponentError: an unknown prefix-cache or attention name.
        kvplug.InvalidArgumentError: a malformed ``host_memory``.
    """

    name = "sglang"
    supported_versions = compat.SUPPORTED_VERSIONS

    def __init__(
        self,
        prefix_cache: str = names.DEFAULT_PREFIX_CACHE,
        attention: str = names.DEFAULT_ATTENTION,
        manager: Callable[[], PluginManager] = default_manager,
        host_memory: int | str | None = None,
    ) -> None:
        manager().registry.get("prefix_cache", prefix_cache)
        self.host_memory = None if host_memory is None else parse_memory_size(host_memory)
        for part in attention.split(","):
            if part.strip() != names.DEFAULT_ATTENTION:
                manager().registry.get("attention", part.strip())
        self.prefix_cache = prefix_cache
        self.attention = attention

    def install(self) -> bool:
        """Register kvplug's components and hooks in this SGLang process and apply the hooks."""
        from kvplug_sglang.sglang_plugin import register

        if not register():
            return False
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()
        return True

    def cli_args(self) -> list[str]:
        """Arguments for ``sglang serve`` / ``python -m sglang.launch_server``."""
        args = ["--kv-backend", "kvplug", "--prefix-cache", self.prefix_cache, "--kvplug-attention", self.attention]
        return args if self.host_memory is None else [*args, "--kvplug-host-memory", str(self.host_memory)]

    def engine_kwargs(self) -> dict[str, Any]:
        """SGLang ``ServerArgs`` fields (``sglang.Engine(**kwargs)``) with the same effect as ``cli_args()``."""
        return {
            "radix_cache_backend": names.radix_cache_backend_name(self.prefix_cache, self.host_memory),
            "attention_backend": names.attention_backend_name(self.attention),
            # decode graphs stay SGLang's ("full" on CUDA: kvplug's graph hooks); prefill graphs are not wired
            "cuda_graph_backend_prefill": "disabled",
        }
