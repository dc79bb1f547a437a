"""kvplug-sglang: SGLang's serving engine on kvplug's KV pool, prefix caches and attention backends.

SGLang loads this package by itself (entry point ``sglang.srt.plugins: kvplug``); see
``sglang_plugin.register``. The modules that subclass SGLang classes (``prefix_cache``,
``attention_backend``, ``pools``) import SGLang and are imported only when used.
"""

from kvplug_sglang._version import __version__
from kvplug_sglang.compat import SUPPORTED_VERSIONS, UnsupportedSGLangError, require_supported_sglang

__all__ = ["SUPPORTED_VERSIONS", "UnsupportedSGLangError", "__version__", "require_supported_sglang"]
