"""The ``events`` extra (pyzmq, msgpack): imported when a publisher is built, never with kvplug."""

from __future__ import annotations

import importlib
from types import ModuleType

from kvplug.interface import KVPlugError

INSTALL_HINT = 'pip install -e ".[events]" (from the root of the kvplug repository: pyzmq and msgpack)'
_DISTRIBUTIONS = {"zmq": "pyzmq", "msgpack": "msgpack"}


class MissingEventsExtraError(KVPlugError, ImportError):
    """pyzmq or msgpack is not installed."""


def import_extra(module: str) -> ModuleType:
    """``module`` of the extra, or an error naming the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingEventsExtraError(
            f"publishing KV events needs {_DISTRIBUTIONS.get(module, module)}, which is not installed: {INSTALL_HINT}"
        ) from error
