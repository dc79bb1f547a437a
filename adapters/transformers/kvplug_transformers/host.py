"""``TransformersHost``: the object the ``"transformers"`` host plugin gives kvplug.

It owns the settings, installs kvplug into transformers' continuous batching, collects cache
statistics from every kvplug cache transformers builds, gives each the server's KV event collector
(``publish_kv_events``, issue 27), runs ``kvplug serve``, and hands ``kvplug bench e2e`` its
runner (``e2e_bench``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator

from kvplug_transformers.installation import install_patches, is_installed, uninstall_patches
from kvplug_transformers.settings import KVPlugSettings
from kvplug_transformers.host_stats import CacheRecord, HostStats

logger = logging.getLogger("kvplug_transformers")


class TransformersHost:
    """kvplug's host adapter for HF transformers' continuous batching.

    Args:
        settings: a ``KVPlugSettings``; keyword ``options`` override its fields.
    """

    name = "transformers"

    def __init__(self, settings: KVPlugSettings | None = None, **options: Any) -> None:
        self.settings = (settings or KVPlugSettings()).updated(**options)
        self._records: list[CacheRecord] = []
        self._lock = threading.Lock()
        self._kv_events: Any = None  # the KVEventCollector every cache built from now on reports to
        self._request_sampling: Any = None

    def sample_per_request(self, sampling: Any) -> None:
        """Caches built from now on sample each request with its own settings, taken from
        ``sampling`` (a ``request_sampling.RequestSampling``; ``kvplug serve`` sets it); ``None``:
        transformers samples as its generation config says (the default)."""
        self._request_sampling = sampling

    # ------------------------------------------------------------------ installation
    def install(self, **options: Any) -> "TransformersHost":
        """Make every continuous-batching run in this process use kvplug with this host's
        settings (``options`` update them first). Installing again switches settings for caches
        built from then on."""
        if options:
            self.settings = self.settings.updated(**options)
        install_patches(self._make_cache)
        _set_active_host(self)
        logger.debug("kvplug installed into transformers continuous batching: %s", self.settings)
        return self

    def uninstall(self) -> None:
        """Give transformers its own paged cache back (for managers created from now on)."""
        if _active_host() is self:
            uninstall_patches()
            _set_active_host(None)
        self._request_sampling = None

    @property
    def installed(self) -> bool:
        return is_installed() and _active_host() is self

    @contextlib.contextmanager
    def installed_context(self, **options: Any) -> Iterator["TransformersHost"]:
        """``with host.installed_context(prefix_cache="naive"): model.generate_batch(...)``."""
        previous = _active_host()
        previous_settings = self.settings
        self.install(**options)
        try:
            yield self
        finally:
            self.settings = previous_settings
            if previous is None:
                self.uninstall()
            else:
                previous.install()

    def _make_cache(self, *args: Any, **kwargs: Any) -> Any:
        from kvplug_transformers.paged_cache import KVPlugPagedCache

        record = CacheRecord(self.settings)
        cache = KVPlugPagedCache(
            *args, settings=self.settings, on_stats=record.update, kv_events=self._kv_events,
            request_sampling=self._request_sampling, **kwargs,
        )
        record.attach(cache)
        with self._lock:
            self._records.append(record)
        return cache

    # ------------------------------------------------------------------ KV events and flushes (issue 27)
    def publish_kv_events(self, collector: Any) -> None:
        """Caches built from now on report their KV events to ``collector`` (a
        ``kvplug.events.KVEventCollector``; ``None``: to nothing)."""
        self._kv_events = collector

    def kv_events_stats(self) -> dict | None:
        """The publisher's counters (``/kvplug/stats``'s ``kv_events``), ``None`` without one."""
        collector = self._kv_events
        return None if collector is None else collector.publisher.stats().to_json()

    def live_caches(self) -> list:
        """The kvplug caches still alive (normally the one of the running manager)."""
        with self._lock:
            records = list(self._records)
        return [cache for cache in (record.cache for record in records) if cache is not None]

    # ------------------------------------------------------------------ statistics
    def stats(self) -> HostStats:
        """Counters summed over every kvplug cache built since install (or ``reset_stats``);
        pool occupancy over the caches still alive."""
        with self._lock:
            records = list(self._records)
        return HostStats.combine(records)

    def reset_stats(self) -> None:
        with self._lock:
            self._records = [record for record in self._records if record.alive]
            for record in self._records:
                record.rebase()

    # ------------------------------------------------------------------ benchmark
    def e2e_bench(self) -> Any:
        """The ``kvplug.bench.e2e_host.E2EHost`` that ``kvplug bench e2e`` runs its workloads
        through (``kvplug_transformers.e2e_bench.TransformersE2E``): found by host name, so the
        core never imports this package."""
        from kvplug_transformers.e2e_bench import TransformersE2E

        return TransformersE2E()

    # ------------------------------------------------------------------ serving
    def serve(self, **options: Any) -> int:
        """Run ``kvplug serve`` (see ``kvplug_transformers.server.serve``); returns the exit code."""
        from kvplug_transformers.server import serve

        return serve(self, **options)


_active: TransformersHost | None = None


def _active_host() -> TransformersHost | None:
    return _active


def _set_active_host(host: TransformersHost | None) -> None:
    global _active
    _active = host
