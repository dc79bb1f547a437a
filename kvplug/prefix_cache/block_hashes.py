"""The page hashes of kvplug's KV cache events: one 64-bit hash per page, chained by its parent.

``page_hash(parent, page)`` is BLAKE2b (8-byte digest) over the parent page's hash (8 bytes,
little-endian, signed; nothing for a page that starts a sequence) followed by the page's token
ids (int32, little-endian), read as a signed little-endian int64. A hash therefore names the
whole prefix ending with its page: equal prefixes hash equally in any cache that uses it, and a
router can rebuild a cache's page tree from the events alone. Hosts that need another engine's
hashes (the SGLang adapter publishes SGLang's) translate from these.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Optional, Sequence

import numpy as np

_LITTLE_ENDIAN = sys.byteorder == "little"


def page_hash(parent: Optional[int], page_bytes: bytes) -> int:
    """Hash of one page: ``page_bytes`` are its token ids as int32 little-endian bytes."""
    digest = hashlib.blake2b(digest_size=8)
    if parent is not None:
        digest.update(parent.to_bytes(8, "little", signed=True))
    digest.update(page_bytes)
    return int.from_bytes(digest.digest(), "little", signed=True)


def chained_page_hashes(token_bytes: bytes, page_size: int, parent: Optional[int]) -> tuple[int, ...]:
    """Hashes of consecutive pages (``token_bytes``: int32 token ids in native byte order, a whole
    number of pages) following the page hashed ``parent`` (``None``: they start a sequence)."""
    if not _LITTLE_ENDIAN:  # the hash is defined over little-endian ids
        token_bytes = np.frombuffer(token_bytes, dtype=np.int32).astype("<i4").tobytes()
    step = page_size * 4
    hashes = []
    for start in range(0, len(token_bytes), step):
        parent = page_hash(parent, token_bytes[start : start + step])
        hashes.append(parent)
    return tuple(hashes)


def block_hashes(token_ids: Sequence[int], page_size: int, parent: Optional[int] = None) -> tuple[int, ...]:
    """Hashes of the whole pages of ``token_ids`` (a trailing partial page is ignored)."""
    usable = len(token_ids) - len(token_ids) % page_size
    return chained_page_hashes(np.asarray(token_ids[:usable], dtype=np.int32).tobytes(), page_size, parent)
