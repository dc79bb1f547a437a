"""Registering the ``KVPLUG`` attention backend with vLLM, and the vLLM internals it relies on.

``register_attention()`` (idempotent: vLLM loads general plugins in its frontend, engine-core and
worker processes) adds ``KVPLUG`` to vLLM's attention-backend registry, so
``--attention-backend KVPLUG`` parses and ``CudaPlatform`` selects it. ``CpuPlatform`` ignores the
selection and always returns ``CPU_ATTN``'s class path, so on CPU kvplug attention is an opt-in
override of that path: ``KVPLUG_VLLM_ATTENTION=1`` in the environment (read when the plugin loads,
in every process, before the model is built) or ``register_attention(cpu_override=True)``.

The kvplug kernel that runs (``kernel_name``): the connector's ``kv_connector_extra_config``
key ``"attention"`` (``"auto"``, ``"torch"``, ``"triton"``, ``"flashinfer"`` or a third-party
name; ``true`` means ``"auto"``), else ``KVPLUG_VLLM_ATTENTION`` when it names one, else ``"auto"``.
vLLM builds the model before it builds the worker's connector, so the extra config cannot switch
the CPU override on by itself; ``check_attention_selection`` makes that a startup error.

``compat.ATTENTION_INTERNALS`` lists every vLLM name the attention part reads, overrides or relies
on, with a fingerprint of vLLM ``PINNED_VLLM_VERSION``; ``check_attention_internals`` recomputes them
and names each one that drifted (``tests/test_vllm_attention_compat.py``). The metadata builder
checks them when vLLM builds it, so a drifted vLLM fails at startup, whatever the version gate
allowed (``KVPLUG_VLLM_ALLOW_UNTESTED`` skips only the version comparison, as in ``compat``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, NamedTuple, Sequence

from kvplug import host_internals
from kvplug.interface import InvalidArgumentError, KVPlugError
from kvplug_vllm.compat import ATTENTION_INTERNALS, PINNED_VERSION as PINNED_VLLM_VERSION, Internal

logger = logging.getLogger(__name__)

BACKEND_NAME = "KVPLUG"
BACKEND_CLASS_PATH = "kvplug_vllm.attention_backend.KvplugAttentionBackend"
ATTENTION_ENV = "KVPLUG_VLLM_ATTENTION"
EXTRA_CONFIG_KEY = "attention"
DEFAULT_KERNEL = "auto"

_OFF = ("", "0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


class UnsupportedVllmAttentionError(KVPlugError, ImportError):
    """vLLM's attention internals differ from the ones ``KVPLUG`` was written against."""


class AttentionRegistration(NamedTuple):
    """What ``register_attention`` left in place: ``KVPLUG`` registered (always ``True`` on
    return), and whether ``CPU_ATTN``'s class path now points at ``KVPLUG``."""

    registered: bool
    cpu_override: bool


# ---------------------------------------------------------------------------------- choice
def _choice(value: Any, source: str) -> str | None:
    """A kvplug kernel name, or ``None`` for off, from an env value or an extra-config value."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_KERNEL
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{source} must be a boolean or a kvplug attention name, got {value!r}")
    text = value.strip()
    if text.lower() in _OFF:
        return None
    if text.lower() in _ON:
        return DEFAULT_KERNEL
    return text


def env_choice(env: Mapping[str, str] | None = None) -> str | None:
    """``KVPLUG_VLLM_ATTENTION`` as a kvplug kernel name (``"1"`` -> ``"auto"``), ``None`` when unset/off."""
    return _choice((os.environ if env is None else env).get(ATTENTION_ENV), ATTENTION_ENV)


def extra_config_choice(vllm_config: Any) -> str | None:
    """The connector extra config's ``"attention"`` as a kvplug kernel name, ``None`` when absent/off."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    return _choice(extra.get(EXTRA_CONFIG_KEY), f"kv_connector_extra_config[{EXTRA_CONFIG_KEY!r}]")


def kernel_name(vllm_config: Any, env: Mapping[str, str] | None = None) -> str:
    """The kvplug attention backend ``KVPLUG`` runs (see the module docstring).

    Raises:
        InvalidArgumentError: the name is not a kvplug attention backend; the message lists them.
    """
    name = extra_config_choice(vllm_config) or env_choice(env) or DEFAULT_KERNEL
    from kvplug.plugins import default_manager

    known = default_manager().available("attention")
    unknown = [part.strip() for part in name.split(",") if part.strip() not in known]
    if unknown or name.count(",") > 1:
        raise InvalidArgumentError(
            f"unknown kvplug attention backend {name!r} (from {EXTRA_CONFIG_KEY!r} in kv_connector_extra_config or "
            f"{ATTENTION_ENV}); available: {', '.join(sorted(known))}, or 'PREFILL,DECODE' of two of them"
        )
    return name


# ---------------------------------------------------------------------------------- registration
def register_attention(*, cpu_override: bool | None = None, env: Mapping[str, str] | None = None) -> AttentionRegistration:
    """Register ``KVPLUG``; on CPU, point ``CPU_ATTN`` at it when asked (idempotent).

    Args:
        cpu_override: override ``CPU_ATTN``'s class path on a CPU platform; ``None``: when
            ``KVPLUG_VLLM_ATTENTION`` is set (to anything but an off value).
        env: the environment to read (``os.environ`` by default).

    Raises:
        UnsupportedVllmAttentionError: ``KVPLUG`` is already registered with another class path.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    members = AttentionBackendEnum.__members__
    if BACKEND_NAME in members:
        path = members[BACKEND_NAME].get_path()
        if path != BACKEND_CLASS_PATH:
            raise UnsupportedVllmAttentionError(
                f"vLLM's attention backend {BACKEND_NAME!r} is already registered as {path!r}, not {BACKEND_CLASS_PATH!r}"
            )
    else:
        register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
    if cpu_override is None:
        cpu_override = env_choice(env) is not None
    overridden = False
    if cpu_override:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            if AttentionBackendEnum.CPU_ATTN.get_path() != BACKEND_CLASS_PATH:
                register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_CLASS_PATH)
                logger.info("kvplug-vllm: CPU_ATTN runs kvplug attention (%s)", BACKEND_CLASS_PATH)
            overridden = True
    return AttentionRegistration(True, overridden)


def cpu_override_active() -> bool:
    """Whether ``CPU_ATTN``'s class path points at ``KVPLUG`` in this process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_CLASS_PATH


def check_attention_selection(vllm_config: Any, env: Mapping[str, str] | None = None) -> None:
    """Refuse a configuration that asks for kvplug attention where it would not run.

    Raises:
        InvalidArgumentError: the extra config asks for kvplug attention on a CPU platform, but
            ``CPU_ATTN`` is not overridden (``KVPLUG_VLLM_ATTENTION`` unset when the plugin loaded).
    """
    choice = extra_config_choice(vllm_config)
    if choice is None:
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not cpu_override_active():
        raise InvalidArgumentError(
            f"kv_connector_extra_config[{EXTRA_CONFIG_KEY!r}]={choice!r} asks for kvplug attention, but on CPU vLLM "
            f"always runs CPU_ATTN unless the plugin overrides it before the model is built: start vLLM with "
            f"{ATTENTION_ENV}=1 in its environment"
        )


# ---------------------------------------------------------------------------------- internals
# The entries are ``compat.ATTENTION_INTERNALS``: the adapter's one table of vLLM internals.


def fingerprint(entry: Internal) -> str:
    """What ``entry.check`` reads from the installed vLLM (``kvplug.host_internals``); the
    ``KVPLUG`` member this plugin adds to vLLM's enum is left out."""
    return host_internals.fingerprint(entry, runtime_members=(BACKEND_NAME,))


def check_attention_internals(entries: Sequence[Internal] = ATTENTION_INTERNALS) -> tuple[str, ...]:
    """One line per entry whose fingerprint differs from the pinned one (or that is gone)."""
    return tuple(host_internals.drift_lines(host_internals.drifted(entries, runtime_members=(BACKEND_NAME,))))


def require_attention_internals(entries: Sequence[Internal] = ATTENTION_INTERNALS) -> None:
    """Raise ``UnsupportedVllmAttentionError`` naming every drifted entry, if any."""
    problems = check_attention_internals(entries)
    if problems:
        raise UnsupportedVllmAttentionError(_drift_message(problems))


def internals_table_markdown(entries: Sequence[Internal] = ATTENTION_INTERNALS) -> str:
    """``ATTENTION_INTERNALS`` as the Markdown table of the adapter docs (a test keeps them equal)."""
    return host_internals.internals_table_markdown(entries, "vLLM name", f"vLLM {PINNED_VLLM_VERSION}")


def _drift_message(problems: Sequence[str]) -> str:
    import vllm

    return (
        f"KVPLUG attention was written against vLLM {PINNED_VLLM_VERSION}; vLLM {vllm.__version__} changed "
        f"{len(problems)} internal(s) it relies on:\n" + "\n".join(problems)
    )
