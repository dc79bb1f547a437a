"""Values in a store: ``MAGIC | BLAKE2b-128(key, payload) | payload``.

The digest covers the key too, so a value that reaches the wrong key (a store bug, a copied
dump) is as corrupt as a flipped byte or a truncated value: ``unframe`` returns ``None`` and the
page is recomputed.
"""

from __future__ import annotations

import hashlib
from typing import Optional

MAGIC = b"KVP\x01"
_DIGEST = 16
HEADER_BYTES = len(MAGIC) + _DIGEST


def _digest(key: str, payload) -> bytes:
    digest = hashlib.blake2b(digest_size=_DIGEST)
    digest.update(key.encode())
    digest.update(b"\0")
    digest.update(payload)
    return digest.digest()


def frame(key: str, payload) -> bytes:
    """The stored value of ``payload`` (bytes-like) under ``key``."""
    return b"".join((MAGIC, _digest(key, payload), payload))


def unframe(key: str, value) -> Optional[memoryview]:
    """The payload of a stored value, or ``None`` if it is not intact or not ``key``'s."""
    if not isinstance(value, (bytes, bytearray, memoryview)) or len(value) <= HEADER_BYTES:
        return None
    view = memoryview(value)
    if view[: len(MAGIC)] != MAGIC:
        return None
    payload = view[HEADER_BYTES:]
    if view[len(MAGIC) : HEADER_BYTES] != _digest(key, payload):
        return None
    return payload
