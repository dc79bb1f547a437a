"""The version gate: every use of transformers internals goes through ``require_transformers()``.

The adapter replaces four things inside transformers' continuous batching, all private
(``Scheduler.add_waiting_request`` is the fourth: kvplug's per-request length check):
``continuous_api.PagedAttentionCache`` (the class ``ContinuousBatchingManager`` instantiates),
``ContinuousBatchingManager.switch_to_cb_friendly_attn`` (which picks the ``paged|...`` attention
function) and ``ModelRunner.compute_batch`` (one step's forward and sampling; kvplug replays
decode steps from its CUDA graphs and then calls ``ModelRunner._sample``). Their contracts were read from the releases listed in ``SUPPORTED_RANGE``; any other
version is refused with an error naming that range, because a silent mismatch would corrupt the
KV cache rather than fail loudly. ``KVPLUG_TRANSFORMERS_SKIP_VERSION_CHECK=1`` skips the version
comparison (the structural checks still run) for people porting the adapter to a new release.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

from kvplug.interface import KVPlugError

MIN_VERSION = (5, 17, 0)
MAX_VERSION_EXCLUSIVE = (5, 18, 0)
SUPPORTED_RANGE = ">=5.17.0,<5.18"
SKIP_CHECK_ENV = "KVPLUG_TRANSFORMERS_SKIP_VERSION_CHECK"
INSTALL_HINT = "pip install 'transformers>=5.17.0,<5.18'"

# attributes the adapter reads or replaces, per module: a release missing one is unsupported
_REQUIRED_ATTRIBUTES = {
    "transformers.generation.continuous_batching.continuous_api": ("PagedAttentionCache", "ContinuousBatchingManager"),
    "transformers.generation.continuous_batching.cache": ("PagedAttentionCache", "group_layers_by_attn_type"),
    "transformers.modeling_utils": ("AttentionInterface", "ALL_ATTENTION_FUNCTIONS"),
    "transformers.generation.continuous_batching.model_runner": ("ModelRunner",),
    "transformers.generation.continuous_batching.scheduler": ("Scheduler",),
}
# methods of those classes the adapter replaces or calls (CUDA-graph decode)
_REQUIRED_METHODS = {
    ("transformers.generation.continuous_batching.model_runner", "ModelRunner"): ("compute_batch", "warmup", "_sample"),
    ("transformers.generation.continuous_batching.scheduler", "Scheduler"): ("add_waiting_request", "_process_candidates"),
}


class UnsupportedTransformersError(KVPlugError, ImportError):
    """transformers is missing, or its version/internals are not the ones the adapter was written for."""


@dataclass(frozen=True)
class TransformersModules:
    """The transformers modules the adapter touches, imported once the version gate passed."""

    version: str
    continuous_api: ModuleType
    cache: ModuleType
    modeling_utils: ModuleType
    model_runner: ModuleType
    scheduler: ModuleType


def parse_version(text: str) -> tuple[int, int, int]:
    """``"5.17.0"`` → ``(5, 17, 0)``; pre-release and local suffixes are ignored (``"5.18.0.dev0"`` → 5.18.0)."""
    numbers: list[int] = []
    for part in text.split("+")[0].split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        numbers.append(int(digits))
        if len(numbers) == 3 or len(digits) != len(part):
            break
    while len(numbers) < 3:
        numbers.append(0)
    return numbers[0], numbers[1], numbers[2]


def is_supported_version(text: str) -> bool:
    return MIN_VERSION <= parse_version(text) < MAX_VERSION_EXCLUSIVE


def check_version(text: str, *, env: dict | None = None) -> None:
    """Raise ``UnsupportedTransformersError`` unless ``text`` is in ``SUPPORTED_RANGE`` (or the check is skipped)."""
    environ = os.environ if env is None else env
    if environ.get(SKIP_CHECK_ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
        return
    if not is_supported_version(text):
        raise UnsupportedTransformersError(
            f"kvplug-transformers supports transformers {SUPPORTED_RANGE}, found transformers {text}. "
            f"Install a supported release ({INSTALL_HINT}), or set {SKIP_CHECK_ENV}=1 to try anyway "
            "(the adapter replaces private continuous-batching internals, so an untested release may break it)."
        )


def require_transformers() -> TransformersModules:
    """Import transformers, check its version and the internals the adapter relies on."""
    import importlib

    try:
        import transformers
    except ImportError as error:
        raise UnsupportedTransformersError(
            f"kvplug-transformers needs transformers {SUPPORTED_RANGE}, which failed to import ({error}); "
            f"install it with `{INSTALL_HINT}`"
        ) from error
    check_version(transformers.__version__)
    modules = {}
    for module_name, attributes in _REQUIRED_ATTRIBUTES.items():
        module = importlib.import_module(module_name)
        missing = [name for name in attributes if not hasattr(module, name)]
        if missing:
            raise UnsupportedTransformersError(
                f"transformers {transformers.__version__} lacks {module_name}.{', '.join(missing)}, which "
                f"kvplug-transformers replaces; supported versions: {SUPPORTED_RANGE} ({INSTALL_HINT})"
            )
        modules[module_name.rsplit(".", 1)[-1]] = module
    for (module_name, class_name), methods in _REQUIRED_METHODS.items():
        owner = getattr(modules[module_name.rsplit(".", 1)[-1]], class_name)
        missing = [name for name in methods if not callable(getattr(owner, name, None))]
        if missing:
            raise UnsupportedTransformersError(
                f"transformers {transformers.__version__} lacks {class_name}.{', '.join(missing)}, which "
                f"kvplug-transformers relies on; supported versions: {SUPPORTED_RANGE} ({INSTALL_HINT})"
            )
    return TransformersModules(
        version=transformers.__version__,
        continuous_api=modules["continuous_api"],
        cache=modules["cache"],
        modeling_utils=modules["modeling_utils"],
        model_runner=modules["model_runner"],
        scheduler=modules["scheduler"],
    )
