"""``mooncake``: pages in a Mooncake Store, ``mooncake://MASTER_HOST:PORT[?OPTION=VALUE&...]``.

The URL names the master's RPC address. kvplug connects as a client that lends no memory
(``global_segment_size`` 0): the pages live in the segments that Mooncake's own processes
(``mooncake_client``, or servers that mount memory) give the cluster, so they outlive any one
kvplug server. Options, in the URL's query or ``options``: ``metadata_server`` (default
``http://MASTER_HOST:8080/metadata``, the master's built-in HTTP metadata server),
``protocol`` (default ``tcp``), ``local_buffer_size`` (bytes, default 64 MiB: the staging buffer
every put and get goes through; batches are split to fit it), ``local_hostname`` (default: this
machine's address on the route to the master), ``timeout`` (seconds, default 1.0).

NOTE: Mooncake's client blocks for seconds (setup ~90 s, get/put ~4-13 s) when its master is gone,
and has no timeout of its own; so every call first opens a TCP connection to the master
(``timeout``), and a refused or timed-out probe is ``KVStoreError("unavailable")`` at once. A
master that accepts connections but hangs is not caught this way.

The client library (``pip install -e ".[mooncake]"``: ``mooncake-transfer-engine-non-cuda``, which
needs Debian's ``libibverbs1`` even over TCP) is imported when a store is built, not when the plugin loads; a
store built without it is a start-up error with the install command.
"""

from __future__ import annotations

import socket
from typing import Any, Iterator, Optional, Sequence
from urllib.parse import parse_qsl, urlsplit

from kvplug.interface.errors import InvalidArgumentError, KVStoreError
from kvplug.interface.kv_store import BaseKVStore, KVStoreConfig, check_batch

DEFAULT_METADATA_PORT = 8080
DEFAULT_BUFFER_BYTES = 64 << 20
DEFAULT_TIMEOUT_S = 1.0
INSTALL_HINT = "apt-get install -y libibverbs1 && pip install mooncake-transfer-engine-non-cuda==0.3.13.post1"
OPTIONS = ("metadata_server", "protocol", "local_buffer_size", "local_hostname", "timeout")
# Mooncake's error codes (mooncake-store types.h) that mean "no room": the rest of a put is dropped
NO_ROOM = {-200: "no segment has room", -600: "a page does not fit the staging buffer"}


class MooncakeKVStore(BaseKVStore):
    def __init__(self, config: KVStoreConfig) -> None:
        where = config.redacted_url
        try:
            parts = urlsplit(config.url)
            host, port = parts.hostname, parts.port
        except ValueError as error:
            raise InvalidArgumentError(f"bad Mooncake URL {where!r}: {error}") from None
        if parts.scheme.lower() != "mooncake" or not host or not port:
            raise InvalidArgumentError(f"expected 'mooncake://MASTER_HOST:PORT[?metadata_server=URL&...]', got {where!r}")
        if parts.path.strip("/") or parts.username or parts.password:
            raise InvalidArgumentError(f"a Mooncake URL has no path or credential (its master has no auth), got {where!r}")
        options: dict[str, Any] = dict(parse_qsl(parts.query, keep_blank_values=True))
        options.update(config.options)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise InvalidArgumentError(f"unknown Mooncake option(s) {unknown}; known: {list(OPTIONS)}")
        self._host, self._port = host, port
        self._where = f"mooncake://{host}:{port}"
        self._metadata = str(options.get("metadata_server") or f"http://{host}:{DEFAULT_METADATA_PORT}/metadata")
        self._protocol = str(options.get("protocol") or "tcp")
        self._buffer_bytes = _positive(options, "local_buffer_size", DEFAULT_BUFFER_BYTES, int)
        self._timeout = _positive(options, "timeout", DEFAULT_TIMEOUT_S, float)
        self._local_hostname = options.get("local_hostname")
        self._store_class = _import_store_class(self._where)
        self._client: Any = None
        self._page_bytes = 0  # the largest page seen: sizes a read batch to the staging buffer

    def exists(self, keys: Sequence[str]) -> int:
        check_batch(keys)
        if not keys:
            return 0
        return _leading_present(self._checked("batch_is_exist", self._connected().batch_is_exist(list(keys))))

    def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> int:
        check_batch(keys, pages)
        client, stored = self._connected(), 0
        for start, stop in self._chunks(pages):
            self._page_bytes = max(self._page_bytes, max(len(page) for page in pages[start:stop]))
            code = client.upsert_batch(list(keys[start:stop]), list(pages[start:stop]))  # a put replaces
            if code == 0:
                stored = stop
                continue
            if code not in NO_ROOM:
                self._drop_client()
                raise KVStoreError(f"{self._where} refused upsert_batch (Mooncake error {code})", reason="unavailable")
            # a full store may have kept the batch's first pages: count them, drop the rest
            present = self._checked("batch_is_exist", client.batch_is_exist(list(keys[start:stop])))
            return start + _leading_present(present)
        return stored

    def get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        check_batch(keys)
        if not keys:
            return []
        client, values = self._connected(), []
        # NOTE: Mooncake answers b"" both for a missing key and a failed read; pages are never empty,
        # so both are None here (a miss), and the probe before the call catches a master that is gone
        if not self._page_bytes:
            self._page_bytes = max(0, int(client.get_size(keys[0])))  # negative: missing, read one by one
        per_call = max(1, self._buffer_bytes // self._page_bytes) if self._page_bytes else 1
        for start in range(0, len(keys), per_call):
            stop = min(len(keys), start + per_call)
            got = client.get_batch(list(keys[start:stop]))
            if not isinstance(got, list) or len(got) != stop - start:
                raise KVStoreError(f"{self._where} answered get_batch of {stop - start} keys with "
                                   f"{type(got).__name__}", reason="protocol")
            values.extend(value if value else None for value in got)
        return values

    def close(self) -> None:
        self._drop_client()

    def describe(self) -> str:
        return self._where

    def __repr__(self) -> str:
        return f"MooncakeKVStore({self._where!r})"

    def _connected(self) -> Any:
        """The client, set up on first use; every call first checks the master accepts connections."""
        try:
            with socket.create_connection((self._host, self._port), timeout=self._timeout) as probe:
                local = probe.getsockname()[0]
        except OSError as error:
            self._drop_client()  # its connections died with the master: set up afresh when it is back
            reason = "timeout" if isinstance(error, socket.timeout) else "unavailable"
            raise KVStoreError(f"{self._where}: the master does not answer ({error})", reason=reason) from None
        if self._client is None:
            client = self._store_class()
            code = client.setup(str(self._local_hostname or local), self._metadata, 0, self._buffer_bytes,
                                self._protocol, "", f"{self._host}:{self._port}")
            if code != 0:
                raise KVStoreError(f"{self._where}: Mooncake client setup failed (error {code}; metadata server "
                                   f"{self._metadata}, protocol {self._protocol})", reason="unavailable")
            self._client = client
        return self._client

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001  (closing a broken client must not hide why it broke)
                pass

    def _checked(self, operation: str, results: Any) -> list[int]:
        if not isinstance(results, list) or any(not isinstance(result, int) for result in results):
            raise KVStoreError(f"{self._where} answered {operation} with {type(results).__name__}", reason="protocol")
        if any(result < 0 for result in results):
            self._drop_client()
            code = next(result for result in results if result < 0)
            raise KVStoreError(f"{self._where} failed {operation} (Mooncake error {code})", reason="unavailable")
        return results

    def _chunks(self, pages: Sequence[bytes]) -> Iterator[tuple[int, int]]:
        """[start, stop) runs of pages whose bytes fit the staging buffer (a page alone may not: Mooncake refuses it)."""
        start, size = 0, 0
        for index, page in enumerate(pages):
            if index > start and size + len(page) > self._buffer_bytes:
                yield start, index
                start, size = index, 0
            size += len(page)
        if start < len(pages):
            yield start, len(pages)


def _leading_present(results: Sequence[int]) -> int:
    count = 0
    for result in results:
        if result != 1:
            break
        count += 1
    return count


def _positive(options: dict, name: str, default: Any, kind: type) -> Any:
    value = options.get(name, default)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"Mooncake option {name} must be a positive number, got {value!r}") from None
    if isinstance(value, bool) or number <= 0:
        raise InvalidArgumentError(f"Mooncake option {name} must be a positive number, got {value!r}")
    return number


def _import_store_class(where: str) -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        raise InvalidArgumentError(f"{where}: Mooncake's client library is not installed ({error}); {INSTALL_HINT}") from None
    return MooncakeDistributedStore
