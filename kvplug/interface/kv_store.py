"""The shared KV store contract (issue 30, additive to version 1): ``BaseKVStore``, ``KVStoreConfig``.

A KV store sits below the host-memory tier and outlives one server: pages of K/V one server
computed are found and loaded by another. Its shape is SGLang HiCache's storage interface: batch
``exists`` (the stored prefix length), batch ``put`` and batch ``get`` of opaque byte values under
string keys. A store only moves bytes; what the keys mean and whether a value is intact is
kvplug's business (``kvplug.kv_store.RemoteKV``: keys chained from the prompt's pages and
namespaced by model, layout, page size, dtype and tensor-parallel rank; values checksummed), so
a third-party store cannot load the wrong K/V by getting those wrong.

Stores are registered by name through ``kvplug_register_kv_stores`` and chosen by URL: the URL's
scheme is the store's name (``redis://127.0.0.1:6379/0`` builds the store registered as ``redis``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence
from urllib.parse import urlsplit

from kvplug.interface.errors import InvalidArgumentError


@dataclass(frozen=True)
class KVStoreConfig:
    """What a store factory receives. Later versions only add defaulted fields.

    Attributes:
        url: where the store is (``scheme://...``); may hold a credential, so a store never logs
            or repeats it (``redacted_url``).
        options: store-specific keyword options (``timeout`` in seconds is understood by the built-ins).
    """

    url: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or "://" not in self.url:
            raise InvalidArgumentError(
                f"a KV store URL is 'scheme://...', e.g. 'redis://127.0.0.1:6379/0'; got a {type(self.url).__name__}"
                + ("" if not isinstance(self.url, str) else f" without '://' ({redact_url(self.url)!r})")
            )
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    @property
    def scheme(self) -> str:
        return self.url.split("://", 1)[0].lower()

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url)

    def __repr__(self) -> str:  # the dataclass repr would print the password
        return f"KVStoreConfig(url={self.redacted_url!r}, options={dict(self.options)!r})"


def redact_url(url: str) -> str:
    """``url`` with any user and password replaced by ``***`` (safe to log)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"***@{host}").geturl()


class BaseKVStore(ABC):
    """Abstract shared KV store: batch operations on opaque byte values under string keys.

    Every batch method takes keys in prompt order (a key names a page and, through the chain, the
    whole prefix ending with it). A store that cannot answer raises ``kvplug.KVStoreError`` with
    its reason; it never raises for a key it does not hold. Values come back byte-identical to
    what was put, or not at all.

    ``concurrent_calls`` (class attribute, default ``False``): the store may be called from two
    threads at once (a store writer's ``put`` while the serving thread reads); ``False`` makes
    ``RemoteKV`` make one call at a time, so a read may wait behind a write (issue 30).
    """

    concurrent_calls: bool = False

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the store holds (HiCache's ``batch_exists``)."""

    @abstractmethod
    def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> int:
        """Store ``pages[i]`` under ``keys[i]``; how many, from the first, are stored now.

        Fewer than ``len(keys)`` means the store dropped the rest (full): not an error. Raises
        ``InvalidArgumentError`` (storing nothing) when the lengths differ or a page is not bytes.
        """

    @abstractmethod
    def get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        """The value of each key (``None`` for a key the store does not hold), in order."""

    def close(self) -> None:
        """Release connections; the store may be used again afterwards (it reconnects)."""

    def describe(self) -> str:
        """One line naming the store for logs and stats; never holds a credential."""
        return type(self).__name__


def check_batch(keys: Sequence[str], pages: Optional[Sequence[bytes]] = None) -> None:
    """Reject a malformed batch before anything is stored (for store implementations)."""
    if isinstance(keys, (str, bytes)) or not all(isinstance(key, str) and key for key in keys):
        raise InvalidArgumentError(f"keys must be a sequence of non-empty str, got {_preview(keys)}")
    if pages is None:
        return
    if len(pages) != len(keys):
        raise InvalidArgumentError(f"put takes one page per key: got {len(keys)} keys and {len(pages)} pages")
    for index, page in enumerate(pages):
        if not isinstance(page, (bytes, bytearray, memoryview)) or len(page) == 0:
            raise InvalidArgumentError(
                f"page {index} must be non-empty bytes, got {type(page).__name__}"
                + (f" of length {len(page)}" if isinstance(page, (bytes, bytearray, memoryview)) else "")
            )


def _preview(keys: Any) -> str:
    if isinstance(keys, (str, bytes)):
        return f"a single {type(keys).__name__}"
    try:
        return "[" + ", ".join(f"{type(key).__name__}" for key in list(keys)[:4]) + (", ...]" if len(keys) > 4 else "]")
    except TypeError:
        return type(keys).__name__
