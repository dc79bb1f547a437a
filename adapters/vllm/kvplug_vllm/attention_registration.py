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

``ATTENTION_INTERNALS`` lists every vLLM name the attention part reads, overrides or relies on,
with a fingerprint of vLLM ``PINNED_VLLM_VERSION``; ``check_attention_internals`` recomputes them
and names each one that drifted (``tests/test_vllm_attention_compat.py``). The metadata builder
checks them when vLLM builds it, so a drifted vLLM fails at startup, whatever the version gate
allowed (``KVPLUG_VLLM_ALLOW_UNTESTED`` skips only the version comparison, as in ``compat``).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

from kvplug.interface import InvalidArgumentError, KVPlugError

logger = logging.getLogger(__name__)

BACKEND_NAME = "KVPLUG"
BACKEND_CLASS_PATH = "kvplug_vllm.attention_backend.KvplugAttentionBackend"
ATTENTION_ENV = "KVPLUG_VLLM_ATTENTION"
EXTRA_CONFIG_KEY = "attention"
DEFAULT_KERNEL = "auto"
PINNED_VLLM_VERSION = "0.32.0"

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
class Check(str, enum.Enum):
    """How a fingerprint is taken."""

    PARAMETERS = "parameters"  # the parameter names of a callable, in order
    SOURCE = "source"  # the first 16 hex digits of the SHA-256 of its source
    FIELDS = "fields"  # a dataclass's field names, in order
    MEMBERS = "members"  # names of an enum's members, in order (those registered at run time excluded)
    VALUE = "value"  # repr of a constant
    HAS = "has"  # which of the fingerprint's comma-separated names are fields of a dataclass


@dataclass(frozen=True)
class Internal:
    """One vLLM name the attention part relies on.

    Attributes:
        owner: the module that defines it.
        attribute: dotted path inside the module.
        check: how ``fingerprint`` reads it.
        why: what kvplug relies on.
        fingerprint: ``fingerprint(self)`` in vLLM ``PINNED_VLLM_VERSION``.
    """

    owner: str
    attribute: str
    check: Check
    why: str
    fingerprint: str

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.attribute}"


_B = "vllm.v1.attention.backend"
_R = "vllm.v1.attention.backends.registry"
ATTENTION_INTERNALS: tuple[Internal, ...] = (
    Internal(_R, "register_backend", Check.PARAMETERS, "adds KVPLUG; overrides CPU_ATTN's class path",
             "backend, class_path, is_mamba"),
    Internal(_R, "AttentionBackendEnum.register", Check.SOURCE, "register_backend('KVPLUG', path) adds an enum member",
             "c751d75289673feb"),
    Internal(_R, "AttentionBackendEnum.get_path", Check.SOURCE, "class paths honour the overrides",
             "3e38e272d6a798f4"),
    Internal("vllm.platforms.cpu", "CpuPlatform.get_attn_backend_cls", Check.SOURCE,
             "the CPU platform returns CPU_ATTN's (overridable) path whatever is selected", "b6eba62a9afd4d18"),
    Internal("vllm.model_executor.layers.attention.attention", "Attention.__init__", Check.SOURCE,
             "the layer builds impl_cls(num_heads, head_size, scale, ...) and looks get_name() up in the enum",
             "13fd4534c6a7cca4"),
    Internal("vllm.model_executor.layers.attention.attention", "Attention.forward", Check.SOURCE,
             "forward_includes_kv_cache_update=True: no separate KV update; q/k/v/output as [tokens, heads, dim]",
             "6c39e4564720ca28"),
    Internal("vllm.model_executor.layers.attention.attention", "unified_attention_with_output", Check.PARAMETERS,
             "impl.forward(layer, q, k, v, kv_cache, metadata, output=...) per layer",
             "query, key, value, output, layer_name, output_scale, output_block_scale, kv_cache_dummy_dep"),
    Internal(_B, "AttentionBackend", Check.SOURCE, "the backend contract KVPLUG implements", "d9e69897934c8dc5"),
    Internal(_B, "AttentionImpl.forward", Check.PARAMETERS, "KvplugAttentionImpl.forward's signature",
             "self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale"),
    Internal(_B, "AttentionImpl.__init__", Check.PARAMETERS, "KvplugAttentionImpl.__init__'s signature",
             "self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype, "
             "logits_soft_cap, attn_type, kv_sharing_target_layer_name"),
    Internal(_B, "AttentionMetadataBuilder.__init__", Check.PARAMETERS, "the builder's constructor",
             "self, kv_cache_spec, layer_names, vllm_config, device"),
    Internal(_B, "AttentionMetadataBuilder.build", Check.PARAMETERS, "build(common_prefix_len, metadata, fast_build)",
             "self, common_prefix_len, common_attn_metadata, fast_build"),
    Internal(_B, "AttentionMetadataBuilder.build_for_cudagraph_capture", Check.PARAMETERS,
             "called once per captured decode size", "self, common_attn_metadata"),
    Internal(_B, "AttentionMetadataBuilder.get_cudagraph_support", Check.SOURCE,
             "returns the class's private _cudagraph_support", "11c4e0e7c94dbeba"),
    Internal(_B, "AttentionCGSupport", Check.MEMBERS, "UNIFORM_SINGLE_TOKEN_DECODE is declared",
             "ALWAYS, UNIFORM_BATCH, UNIFORM_SINGLE_TOKEN_DECODE, NEVER"),
    Internal(_B, "CommonAttentionMetadata", Check.HAS, "the step's fields KVPLUG reads",
             "query_start_loc_cpu, seq_lens, seq_lens_cpu_upper_bound, num_reqs, num_actual_tokens, "
             "block_table_tensor, slot_mapping"),
    Internal("vllm.v1.attention.backends.utils", "PAD_SLOT_ID", Check.VALUE, "padding tokens' slot, clamped to 0", "-1"),
    Internal("vllm.v1.attention.backends.utils", "NULL_BLOCK_ID", Check.VALUE,
             "padding requests' block; kvplug's dummy request points at its slot 0", "0"),
    Internal("vllm.v1.kv_cache_layout", "KVCacheLayout", Check.MEMBERS, "LBNHC is declared",
             "LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC"),
    Internal("vllm.v1.kv_cache_layout", "KVCacheLayout.LBNHC", Check.VALUE,
             "[L, B, N, H, C]: token-major blocks, layers outermost", "<KVCacheLayout.LBNHC: (0, 1, 3, 2, 4)>"),
    Internal("vllm.v1.kv_cache_interface", "create_kv_cache_views", Check.SOURCE,
             "per-layer [B, H, N, C] views of one buffer, block stride = page", "3626347655c8c6f6"),
    Internal("vllm.v1.kv_cache_interface", "AttentionSpec.state_content_size_bytes", Check.SOURCE,
             "C is K then V: (head_size + head_size_v) elements", "c7df4c0d7eede003"),
    Internal("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._build_attention_metadata", Check.SOURCE,
             "padding: seq_lens 0, query length 0, null-block rows, num_actual_tokens padded only for FULL graphs",
             "6015ffa2b3ec7cd3"),
    Internal("vllm.config.compilation", "CompilationConfig", Check.HAS,
             "static_forward_context (layers by name) and cudagraph_capture_sizes are read",
             "static_forward_context, cudagraph_capture_sizes"),
    Internal("vllm.config.scheduler", "SchedulerConfig", Check.HAS, "sizes the token table and batch buffers",
             "max_num_seqs, max_num_batched_tokens"),
)


def resolve(entry: Internal) -> Any:
    """The object ``entry`` names (raises ``ImportError`` / ``AttributeError`` when it is gone)."""
    value: Any = importlib.import_module(entry.owner)
    for part in entry.attribute.split("."):
        value = inspect.getattr_static(value, part) if inspect.isclass(value) else getattr(value, part)
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
    return value


def fingerprint(entry: Internal) -> str:
    """What ``entry.check`` reads from the installed vLLM (see ``Check``)."""
    value = resolve(entry)
    if entry.check is Check.PARAMETERS:
        return ", ".join(inspect.signature(value).parameters)
    if entry.check is Check.SOURCE:
        return hashlib.sha256(inspect.getsource(value).encode()).hexdigest()[:16]
    if entry.check is Check.FIELDS:
        return ", ".join(field.name for field in dataclasses.fields(value))
    if entry.check is Check.HAS:
        present = {field.name for field in dataclasses.fields(value)}
        return ", ".join(name for name in entry.fingerprint.split(", ") if name in present)
    if entry.check is Check.MEMBERS:
        runtime = {BACKEND_NAME}
        return ", ".join(name for name in value.__members__ if name not in runtime)
    return repr(value)


def check_attention_internals(entries: Sequence[Internal] = ATTENTION_INTERNALS) -> tuple[str, ...]:
    """One line per entry whose fingerprint differs from the pinned one (or that is gone)."""
    problems = []
    for entry in entries:
        try:
            found = fingerprint(entry)
        except (ImportError, AttributeError, TypeError, OSError) as error:
            problems.append(f"{entry.name} ({entry.check.value}; {entry.why}): missing ({type(error).__name__}: {error})")
            continue
        if found != entry.fingerprint:
            problems.append(
                f"{entry.name} ({entry.check.value}; {entry.why}): expected {entry.fingerprint!r}, found {found!r}"
            )
    return tuple(problems)


def require_attention_internals(entries: Sequence[Internal] = ATTENTION_INTERNALS) -> None:
    """Raise ``UnsupportedVllmAttentionError`` naming every drifted entry, if any."""
    problems = check_attention_internals(entries)
    if problems:
        raise UnsupportedVllmAttentionError(_drift_message(problems))


def _drift_message(problems: Sequence[str]) -> str:
    import vllm

    return (
        f"KVPLUG attention was written against vLLM {PINNED_VLLM_VERSION}; vLLM {vllm.__version__} changed "
        f"{len(problems)} internal(s) it relies on:\n"
        + "\n".join(f"- {line}" for line in problems)
    )


def internals_table_markdown(entries: Sequence[Internal] = ATTENTION_INTERNALS) -> str:
    """The table for the adapter README."""
    lines = ["| vLLM name | check | why |", "|---|---|---|"]
    lines += [f"| `{entry.name}` | {entry.check.value} | {entry.why} |" for entry in entries]
    return "\n".join(lines)
