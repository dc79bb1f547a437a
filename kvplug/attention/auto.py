"""``auto``: the best backend this machine can run, chosen once and logged.

On a CUDA pool: ``flashinfer`` when FlashInfer imports, else ``triton`` when Triton imports, else
``torch``. Off CUDA: ``torch``. Only ``auto`` ever falls back; a backend asked for by name whose
library is missing raises an ``ImportError`` that names the extra to install.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable

from kvplug.interface import AttentionConfig, BaseAttentionBackend

logger = logging.getLogger(__name__)


def _importable(module: str) -> bool:
    # a real import, not find_spec: a broken install must not be chosen
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any failure means "not usable here"
        logger.debug("attention backend 'auto': %s is not importable (%s)", module, error)
        return False
    return True


def choose_backend_name(config: AttentionConfig, importable: Callable[[str], bool] = _importable) -> str:
    """The name ``auto`` resolves to for ``config``'s pool device."""
    if config.pool.device.type != "cuda":
        return "torch"
    if importable("flashinfer"):
        return "flashinfer"
    if importable("triton"):
        return "triton"
    return "torch"


def create_auto_backend(config: AttentionConfig) -> BaseAttentionBackend:
    """Build the backend ``choose_backend_name`` picks; options pass through unchanged."""
    from kvplug.builtin import attention as builtin

    name = choose_backend_name(config)
    factories = {"flashinfer": builtin.create_flashinfer, "triton": builtin.create_triton, "torch": builtin.create_torch}
    logger.info("attention backend 'auto' chose %r for a pool on %s", name, config.pool.device)
    return factories[name](config)
