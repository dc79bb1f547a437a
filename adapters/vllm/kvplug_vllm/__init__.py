"""kvplug-vllm: vLLM's prefix cache on kvplug (``--kv-transfer-config '{"kv_connector":"KvplugConnector",...}'``).

vLLM loads this package by itself (entry point ``vllm.general_plugins: kvplug``, see
``vllm_plugin.register``). The modules that subclass vLLM classes (``connector``,
``prefix_caching``, ``stats_route``) import vLLM and are imported only when vLLM uses them.
"""

from kvplug_vllm._version import __version__
from kvplug_vllm.compat import SUPPORTED_VERSIONS, UnsupportedVLLMError, require_supported_vllm

__all__ = ["SUPPORTED_VERSIONS", "UnsupportedVLLMError", "__version__", "require_supported_vllm"]
