"""``dir:///PATH``: a shared KV store in a directory, one file per page (an example store plugin).

Servers that mount the same directory share their pages. A page is written to a temporary file
and renamed into place, so a reader sees a whole page or none (rename is atomic on one file
system). The file name is the key's SHA-256, since keys are arbitrary strings. What a key means
and whether a value is intact is kvplug's business (``kvplug.kv_store.RemoteKV`` checksums every
page), so this store only moves bytes.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Optional, Sequence
from urllib.parse import urlsplit

from kvplug import BaseKVStore, KVStoreConfig, KVStoreError
from kvplug.interface.kv_store import check_batch


class DirectoryKVStore(BaseKVStore):
    concurrent_calls = True  # each call touches its own files; a rename is atomic

    def __init__(self, config: KVStoreConfig) -> None:
        path = urlsplit(config.url).path
        if not path:
            raise KVStoreError(f"a directory store URL is dir:///ABSOLUTE/PATH, got {config.redacted_url!r}")
        self._root = path
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as error:
            raise KVStoreError(f"cannot use {path!r} as a KV store directory: {error}") from error

    def _file(self, key: str) -> str:
        return os.path.join(self._root, hashlib.sha256(key.encode()).hexdigest())

    def exists(self, keys: Sequence[str]) -> int:
        check_batch(keys)
        count = 0
        for key in keys:
            if not os.path.exists(self._file(key)):
                break
            count += 1
        return count

    def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> int:
        check_batch(keys, pages)
        for key, page in zip(keys, pages):
            try:
                handle, temporary = tempfile.mkstemp(dir=self._root, prefix=".partial-")
                with os.fdopen(handle, "wb") as out:
                    out.write(page)
                os.replace(temporary, self._file(key))
            except OSError as error:
                raise KVStoreError(f"cannot write a page to {self._root!r}: {error}") from error
        return len(keys)

    def get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        check_batch(keys)
        pages: list[Optional[bytes]] = []
        for key in keys:
            try:
                with open(self._file(key), "rb") as handle:
                    pages.append(handle.read())
            except FileNotFoundError:
                pages.append(None)
            except OSError as error:
                raise KVStoreError(f"cannot read a page from {self._root!r}: {error}") from error
        return pages

    def describe(self) -> str:
        return f"dir://{self._root}"
