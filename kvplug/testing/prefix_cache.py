"""Running the prefix-cache conformance checks: all at once, one by one, or as pytest parameters."""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

import torch

from kvplug.testing import checks_entries, checks_eviction, differential
from kvplug.testing.context import CheckContext, PrefixCacheFactory
from kvplug.testing.dependencies import KitDependencyError, require_hypothesis
from kvplug.testing.report import KitReport, factory_name

DEFAULT_PAGE_SIZES = (1, 4, 16)

# (check, applies to caches that keep entries, applies to caches that keep nothing, needs LRU)
_CATALOGUE: tuple[tuple[Callable[[CheckContext], None], bool, bool, bool], ...] = (
    (checks_entries.match_returns_inserted_values, True, False, False),
    (checks_entries.empty_and_unknown_keys_match_nothing, True, True, False),
    (checks_entries.split_keeps_values_and_sizes, True, False, False),
    (checks_entries.duplicate_insert_reports_cached_len, True, False, False),
    (checks_entries.lengths_are_page_multiples, True, True, False),
    (checks_entries.bad_input_is_rejected, True, True, False),
    (checks_eviction.locks_nest_and_protect_entries, True, False, False),
    (checks_eviction.evict_zero_is_a_noop, True, True, False),
    (checks_eviction.evict_beyond_evictable_raises, True, True, False),
    (checks_eviction.eviction_is_least_recently_used_first, True, False, True),
    (checks_eviction.evicted_prefix_no_longer_matches, True, False, False),
    (checks_eviction.reset_forgets_everything, True, True, False),
    (checks_eviction.keeps_nothing, False, True, False),
    (differential.randomised_differential, True, False, False),
)


class PrefixCacheCheck(NamedTuple):
    """One named conformance check; ``run`` raises ``AssertionError`` naming it on failure."""

    name: str
    description: str
    function: Callable[[CheckContext], None]
    keeps_entries: bool
    lru: bool

    def run(
        self,
        factory: PrefixCacheFactory,
        page_size: int = 1,
        device: Any = "cpu",
        *,
        slow: bool = False,
        shrink: bool = True,
    ) -> None:
        """Run this check against caches built by ``factory`` at ``page_size`` on ``device``.

        ``slow`` and ``shrink`` only affect the randomised check (see ``check_prefix_cache``).
        """
        context = CheckContext(
            factory,
            page_size,
            torch.device(device),
            keeps_entries=self.keeps_entries,
            lru=self.lru,
            slow=slow,
            shrink=shrink,
        )
        try:
            self.function(context)
        except KitDependencyError:
            raise  # the environment lacks a package: not a verdict on the cache
        except Exception as error:
            notes = "".join(f"\n{note}" for note in getattr(error, "__notes__", ()))
            raise AssertionError(
                f"prefix-cache check {self.name!r} failed (page_size={page_size}, device={context.device}): "
                f"{type(error).__name__ + ': ' if not isinstance(error, AssertionError) else ''}{error}{notes}"
            ) from error

    def __repr__(self) -> str:
        return f"PrefixCacheCheck({self.name!r})"


def left_out_checks(*, keeps_entries: bool = True, lru: bool = True, randomised: bool = True) -> list[tuple[str, str]]:
    """``(check, why)`` for the catalogue's checks these options leave out (``KitReport.left_out``)."""
    left_out = []
    for function, for_keeping, for_nothing, needs_lru in _CATALOGUE:
        if not (for_keeping if keeps_entries else for_nothing):
            why = "keeps_entries=False" if keeps_entries is False else "applies to caches that keep nothing"
        elif needs_lru and not lru:
            why = "lru=False"
        elif function is differential.randomised_differential and not randomised:
            why = "randomised=False"
        else:
            continue
        left_out.append((function.__name__, why))
    return left_out


def prefix_cache_checks(*, keeps_entries: bool = True, lru: bool = True, randomised: bool = True) -> list[PrefixCacheCheck]:
    """The checks that apply to a cache.

    Args:
        keeps_entries: ``False`` for a cache that keeps nothing by design (like ``naive``): only
            the checks that apply to it run (match/insert report 0, sizes stay 0, evict(0) is a
            no-op, evict(n > 0) raises, reset works, bad input is rejected).
        lru: ``False`` for a cache whose eviction policy is not least-recently-used: the LRU
            order is then not checked (everything else, lock safety included, still is).
        randomised: ``False`` leaves out the randomised differential check (the one that needs
            hypothesis).

    Raises:
        KitDependencyError: the randomised check is selected and hypothesis is not installed.
    """
    checks = []
    for function, for_keeping, for_nothing, needs_lru in _CATALOGUE:
        if not (for_keeping if keeps_entries else for_nothing) or (needs_lru and not lru):
            continue
        if function is differential.randomised_differential:
            if not randomised:
                continue
            require_hypothesis()
        description = (function.__doc__ or "").strip().splitlines()[0]
        checks.append(PrefixCacheCheck(function.__name__, description, function, keeps_entries, lru))
    return checks


def check_prefix_cache(
    factory: PrefixCacheFactory,
    page_sizes: Iterable[int] = DEFAULT_PAGE_SIZES,
    device: Any = "cpu",
    *,
    keeps_entries: bool = True,
    lru: bool = True,
    slow: bool = False,
    shrink: bool = True,
    randomised: bool = True,
) -> KitReport:
    """Run every applicable check at every page size; the first failure raises ``AssertionError``.
    Returns the ``KitReport`` of the passed run (``print`` it for the summary).

    A missing optional dependency (hypothesis, for the randomised check) raises
    ``KitDependencyError`` before any check runs; ``randomised=False`` runs the others without it.

    Args:
        factory: ``factory(config: kvplug.PrefixCacheConfig) -> kvplug.BasePrefixCache``, e.g. the
            factory your plugin registers, or ``lambda config: MyCache(config)``.
        page_sizes: page sizes to build caches with.
        device: device of the token-id and location tensors.
        keeps_entries, lru: see ``prefix_cache_checks``.
        slow: a longer randomised differential run (500 examples per page size instead of 50).
        shrink: on a randomised failure, search for a minimal failing operation list (can take a
            minute; ``False`` reports the first failing list as found).
    """
    checks = prefix_cache_checks(keeps_entries=keeps_entries, lru=lru, randomised=randomised)
    sizes = tuple(page_sizes)
    for page_size in sizes:
        for check in checks:
            check.run(factory, page_size, device, slow=slow, shrink=shrink)
    return KitReport("prefix cache", factory_name(factory), sizes, tuple(check.name for check in checks),
                     tuple(left_out_checks(keeps_entries=keeps_entries, lru=lru, randomised=randomised)),
                     len(checks) * len(sizes))


def parametrize_prefix_cache_checks(
    page_sizes: Iterable[int] = DEFAULT_PAGE_SIZES,
    *,
    keeps_entries: bool = True,
    lru: bool = True,
    randomised: bool = True,
) -> Any:
    """A ``pytest.mark.parametrize`` over ``(prefix_cache_check, page_size)``, one test id per pair
    (a missing hypothesis is a ``KitDependencyError`` at collection, see ``check_prefix_cache``)."""
    import pytest  # only test code calls this

    checks = prefix_cache_checks(keeps_entries=keeps_entries, lru=lru, randomised=randomised)
    pairs = [(check, page_size) for page_size in page_sizes for check in checks]
    return pytest.mark.parametrize(
        ("prefix_cache_check", "page_size"),
        pairs,
        ids=[f"{check.name}-page{page_size}" for check, page_size in pairs],
    )
