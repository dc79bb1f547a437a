"""Sizes given on the command line: ``parse_memory_size`` with every failure a one-line error
naming the flag (a huge number such as ``1e400`` overflows to infinity and is refused too)."""

from __future__ import annotations

from kvplug.interface import InvalidArgumentError, KVPlugError
from kvplug.memory.capacity import parse_memory_size

MAX_SIZE = 1 << 60  # one exbibyte: no memory budget or request is larger


def parse_size(flag: str, text: str) -> int:
    """Bytes from ``text`` ('40GiB', '512MiB', '1000000') for ``flag``."""
    try:
        size = parse_memory_size(text)
    except (OverflowError, ValueError) as error:
        raise InvalidArgumentError(f"{flag} must be a size ('40GiB', '512MiB', '1000000'), got {text!r}: {error}") from None
    except KVPlugError as error:
        raise InvalidArgumentError(f"{flag}: {error}") from None
    if size > MAX_SIZE:
        raise InvalidArgumentError(f"{flag} must be at most {MAX_SIZE:,} bytes (1 EiB), got {text!r}")
    return size
