"""Conformance kit for kvplug components (docs/design.md, section 3): the suite the built-in prefix caches pass.

A plugin author runs it against their own factory, in one call::

    from kvplug.testing import check_prefix_cache
    print(check_prefix_cache(lambda config: MyCache(config), page_sizes=(1, 4, 16)))

which returns a ``KitReport`` once every check passed: the checks that ran, at which page sizes,
and the ones the options left out (printed, one line).

or as one pytest test per check and page size (failures then name the check in the test id)::

    import kvplug.testing as kit
    from my_plugin import MyCache

    @kit.parametrize_prefix_cache_checks(page_sizes=(1, 16))
    def test_my_cache_conforms(prefix_cache_check, page_size):
        prefix_cache_check.run(MyCache, page_size=page_size, device="cpu")

    def test_my_cache_long_random_run():  # e.g. behind your own "slow" marker
        kit.check_prefix_cache(MyCache, page_sizes=(16,), slow=True)

``import kvplug`` is enough: ``kvplug.testing`` loads on first use. The randomised check needs
hypothesis (``pip install 'hypothesis>=6.80'``, or ``pip install -e '.[test]'`` in the repository); without it the kit raises ``KitDependencyError``
before running anything (``randomised=False`` runs the other checks).

Options: ``keeps_entries=False`` for a cache that keeps nothing (like ``naive``); ``lru=False``
for an eviction policy other than least-recently-used. The contract checked (see
``kvplug.testing.model`` for the precise recency rule): exact values back from match; splits keep
values and sizes; duplicate inserts report the cached length; locks nest and protect; ``evict(0)``
is a no-op; evicting more than is evictable raises and evicts nothing; LRU order; evicted prefixes
no longer match; lengths are page multiples; empty/unknown keys match nothing; reset; bad input
is rejected; and a randomised differential run (hypothesis, imported lazily) against a dict-based
model with ``check_integrity()`` after every operation. Run time is bounded: 50 random examples
per page size by default (reproducible), ``slow=True`` for 500 fresh ones; a random failure is
shrunk to a minimal operation list unless ``shrink=False``.

Tiered caches (a host-memory tier, ``kvplug.BaseTieredPrefixCache``): ``check_tiered_prefix_cache(factory)``
runs the same suite with a small pool attached (evictions then move prefixes to host memory) plus
the tier's own checks (``kvplug.testing.tiered``): bit-identical round trips, LRU drops when host
memory is full, locked host prefixes kept, and a randomised run checking K/V content on every hit.

Shared KV stores (``kvplug.BaseKVStore``, issue 30): ``check_kv_store(factory)`` (``kvplug.testing.kv_store``).
"""

from kvplug.testing.context import CheckContext, PrefixCacheFactory
from kvplug.testing.dependencies import KitDependencyError
from kvplug.testing.model import ReferencePrefixCache
from kvplug.testing.prefix_cache import (
    DEFAULT_PAGE_SIZES,
    PrefixCacheCheck,
    check_prefix_cache,
    parametrize_prefix_cache_checks,
    prefix_cache_checks,
)
from kvplug.testing.report import KitReport
from kvplug.testing.kv_store import KVStoreCheck, check_kv_store, kv_store_checks, parametrize_kv_store_checks
from kvplug.testing.tiered import TieredKit, check_tiered_prefix_cache

__all__ = [
    "DEFAULT_PAGE_SIZES",
    "CheckContext",
    "KVStoreCheck",
    "KitDependencyError",
    "KitReport",
    "PrefixCacheCheck",
    "PrefixCacheFactory",
    "ReferencePrefixCache",
    "TieredKit",
    "check_kv_store",
    "check_prefix_cache",
    "check_tiered_prefix_cache",
    "kv_store_checks",
    "parametrize_kv_store_checks",
    "parametrize_prefix_cache_checks",
    "prefix_cache_checks",
]
