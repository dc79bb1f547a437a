"""The conformance kit's optional dependency (hypothesis, for the randomised check), checked once,
up front: a missing package is one clear error before any check runs, never a failed check."""

from __future__ import annotations

import importlib.util

from kvplug.interface import KVPlugError

HYPOTHESIS_HINT = "pip install 'hypothesis>=6.80' (or, in the kvplug repository, pip install -e '.[test]')"


class KitDependencyError(KVPlugError, ImportError):
    """A package the conformance kit needs is not installed (not a conformance failure)."""


def require_hypothesis() -> None:
    """Raise ``KitDependencyError`` unless hypothesis can be imported."""
    if importlib.util.find_spec("hypothesis") is None:
        raise KitDependencyError(
            "the conformance kit's randomised check (randomised_differential) needs hypothesis, which is "
            f"not installed: {HYPOTHESIS_HINT}; or run the other checks with randomised=False"
        )
