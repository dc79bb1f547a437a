"""The ``vllm.general_plugins`` entry point: registers ``KvplugConnector`` with vLLM's connector factory.

vLLM calls ``register()`` in its frontend, in EngineCore and in every worker, and may call it more
than once in one process: it only adds the factory entry when it is missing (lazy: the connector
module is imported when vLLM builds a connector). An unsupported vLLM is reported here once, in
the log, and again as the startup error when a connector is built (``compat``): a server that
does not ask for ``KvplugConnector`` keeps running natively.
"""

from __future__ import annotations

import logging

from kvplug_vllm.compat import UnsupportedVLLMError, check_version, installed_vllm_version

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "KvplugConnector"  # kvplug_vllm.connector.CONNECTOR_NAME, without importing vLLM's connector API


def register() -> None:
    """Make ``--kv-transfer-config '{"kv_connector":"KvplugConnector",...}'`` resolve (idempotent)."""
    try:
        check_version(installed_vllm_version())
    except UnsupportedVLLMError as error:
        logger.error("kvplug-vllm: %s", error)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvplug_vllm.connector", "KvplugConnector")
    from kvplug_vllm.attention_registration import register_attention

    register_attention()  # --attention-backend KVPLUG; on CPU, CPU_ATTN -> KVPLUG with KVPLUG_VLLM_ATTENTION=1
