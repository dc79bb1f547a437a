"""Shared KV stores below the host-memory tier (issue 30): stores, keys, framing, and ``RemoteKV``.

``RemoteKV`` is what the serving path talks to: it turns a prompt into namespaced chained page
keys (``keys``), checksums values (``framing``), and turns every store fault into a counted miss
or dropped write (``remote``). Stores (``BaseKVStore`` plugins: ``redis``, ``mooncake``, ``memory``) only move bytes.
"""

from kvplug.kv_store.keys import KVNamespace, page_keys
from kvplug.kv_store.remote import RemoteKV, RemoteKVStats, open_remote_kv

__all__ = ["KVNamespace", "RemoteKV", "RemoteKVStats", "open_remote_kv", "page_keys"]
