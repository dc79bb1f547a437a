"""Installing kvplug's per-request sampler into transformers' own continuous batching (``--kv-backend native``).

One internal is replaced, ``ModelRunner._sample`` (the ``patched`` entry of ``compat.INTERNALS``
that the kvplug cache's installation replaces too): it hands each step to the active
``NativeStepSampler``, which calls the original for every row it does not sample itself. Nothing
else of transformers changes: its cache, scheduler and logits processors stay its own. The
replacement looks up the current original at install time, so it composes with ``installation``.
"""

from __future__ import annotations

import threading
from typing import Any

from kvplug_transformers.compat import ORIGINAL_ATTRIBUTE, require_transformers

_lock = threading.Lock()
_active: Any = None  # the NativeStepSampler, while installed


def install_native_sampler(step_sampler: Any) -> None:
    """Route transformers' ``ModelRunner._sample`` through ``step_sampler`` (a ``NativeStepSampler``);
    installing again only replaces the sampler."""
    global _active
    with _lock:
        runner_class = require_transformers().model_runner.ModelRunner
        if _active is None:
            original = runner_class._sample

            def native_sample(runner: Any, scores: Any, output_ids: Any) -> None:
                sampler = _active
                if sampler is None:
                    original(runner, scores, output_ids)
                else:
                    sampler.sample(runner, scores, output_ids, original)

            setattr(native_sample, ORIGINAL_ATTRIBUTE, original)
            runner_class._sample = native_sample
        _active = step_sampler


def uninstall_native_sampler() -> None:
    """Put transformers' ``_sample`` back (what was there before ``install_native_sampler``)."""
    global _active
    with _lock:
        if _active is None:
            return
        runner_class = require_transformers().model_runner.ModelRunner
        runner_class._sample = getattr(runner_class._sample, ORIGINAL_ATTRIBUTE)
        _active = None


def is_installed() -> bool:
    return _active is not None
