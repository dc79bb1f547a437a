"""The built-in prefix caches pass ``kvplug.testing``, and the kit fails caches that break the contract."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kvplug
import kvplug.testing as kit
from kvplug.interface import InsertResult, PrefixCacheConfig
from kvplug.prefix_cache.radix import RadixPrefixCache
from kvplug.testing.model import ReferencePrefixCache


def radix_factory(config: PrefixCacheConfig):
    return kvplug.create_prefix_cache("radix", device=config.device, page_size=config.page_size)


def naive_factory(config: PrefixCacheConfig):
    return kvplug.create_prefix_cache("naive", device=config.device, page_size=config.page_size)


@kit.parametrize_prefix_cache_checks(page_sizes=(1, 4, 16))
def test_radix_passes_the_kit(prefix_cache_check, page_size):
    prefix_cache_check.run(radix_factory, page_size=page_size)


@kit.parametrize_prefix_cache_checks(page_sizes=(1, 4, 16), keeps_entries=False)
def test_naive_passes_the_parts_for_a_cache_that_keeps_nothing(prefix_cache_check, page_size):
    prefix_cache_check.run(naive_factory, page_size=page_size)


def test_check_prefix_cache_runs_the_whole_suite_in_one_call():
    kit.check_prefix_cache(radix_factory, page_sizes=(2,))
    kit.check_prefix_cache(naive_factory, page_sizes=(2,), keeps_entries=False)


def test_a_passed_run_reports_what_it_checked():
    """Issue 29: a pass printed nothing. The report names every check that ran (the same list as
    ``prefix_cache_checks``), the page sizes, the runs, and what the options left out and why."""
    report = kit.check_prefix_cache(radix_factory, page_sizes=(1, 4), lru=False)
    ran = [check.name for check in kit.prefix_cache_checks(lru=False)]
    assert report.checks == tuple(ran) and report.page_sizes == (1, 4) and report.runs == 2 * len(ran)
    assert report.left_out == (("eviction_is_least_recently_used_first", "lru=False"),
                               ("keeps_nothing", "applies to caches that keep nothing"))
    text = str(report)
    assert text.startswith(f"kvplug conformance kit (prefix cache): {report.cache} passed {len(ran)} checks at page "
                           "sizes 1, 4") and "eviction_is_least_recently_used_first (lru=False)" in text
    assert "radix_factory" in report.cache
    naive = kit.check_prefix_cache(naive_factory, page_sizes=(2,), keeps_entries=False, randomised=False)
    assert set(naive.checks) == {check.name for check in kit.prefix_cache_checks(keeps_entries=False)}
    assert ("match_returns_inserted_values", "keeps_entries=False") in naive.left_out
    assert ("randomised_differential", "keeps_entries=False") in naive.left_out


def test_the_command_line_in_the_readme_prints_the_summary(tmp_path):
    import subprocess
    import sys

    code = ("import kvplug; print(kvplug.testing.check_prefix_cache("
            "lambda c: kvplug.create_prefix_cache('radix', page_size=c.page_size), page_sizes=(1,), randomised=False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith("kvplug conformance kit (prefix cache): ") and "randomised_differential (randomised=False)" in out


@pytest.mark.slow
def test_radix_long_randomised_run():
    kit.check_prefix_cache(radix_factory, page_sizes=(1, 4, 16), slow=True)


def test_check_selection_follows_the_options():
    keeping = {check.name for check in kit.prefix_cache_checks()}
    nothing = {check.name for check in kit.prefix_cache_checks(keeps_entries=False)}
    assert {"randomised_differential", "eviction_is_least_recently_used_first", "locks_nest_and_protect_entries"} <= (
        keeping
    )
    assert "keeps_nothing" in nothing and "keeps_nothing" not in keeping
    assert not {"randomised_differential", "split_keeps_values_and_sizes"} & nothing
    assert {"evict_zero_is_a_noop", "evict_beyond_evictable_raises", "reset_forgets_everything"} <= keeping & nothing
    assert "eviction_is_least_recently_used_first" not in {check.name for check in kit.prefix_cache_checks(lru=False)}


def test_importing_the_kit_does_not_import_hypothesis():
    code = "import sys, kvplug.testing; assert 'hypothesis' not in sys.modules, 'hypothesis imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------ the kit catches broken caches


class ForgetsRecencyOnMatch(RadixPrefixCache):
    """match_prefix does not refresh LRU recency."""

    def match_prefix(self, input_ids):
        self._touch_path = lambda node: None  # shadows the method for this call only
        try:
            return super().match_prefix(input_ids)
        finally:
            del self._touch_path


class MisreportsCachedLen(RadixPrefixCache):
    """insert_prefix always claims nothing was cached (the caller would leak its duplicates)."""

    def insert_prefix(self, input_ids, indices):
        return InsertResult(0, super().insert_prefix(input_ids, indices).handle)


class IgnoresLocks(RadixPrefixCache):
    """lock_handle does nothing, so locked entries get evicted."""

    def lock_handle(self, handle, unlock=False):
        pass


class EvictsOnEvictZero(RadixPrefixCache):
    """evict(0) frees a page when it can."""

    def evict(self, size):
        if size == 0 and self.size_info.evictable_size:
            size = 1
        return super().evict(size)


class ClampsOversizedEvict(RadixPrefixCache):
    """evict(n > evictable) evicts everything instead of raising."""

    def evict(self, size):
        return super().evict(min(size, self.size_info.evictable_size))


class SplitCorruptsValues(RadixPrefixCache):
    """A node split shifts one location of the upper half."""

    def _split(self, child, at_bytes):
        upper = super()._split(child, at_bytes)
        upper.value = upper.value[:-4] + (int.from_bytes(upper.value[-4:], sys.byteorder) + 1).to_bytes(4, sys.byteorder)
        return upper


BROKEN_CACHES = [
    (ForgetsRecencyOnMatch, "eviction_is_least_recently_used_first"),
    (MisreportsCachedLen, "duplicate_insert_reports_cached_len"),
    (IgnoresLocks, "locks_nest_and_protect_entries"),
    (EvictsOnEvictZero, "evict_zero_is_a_noop"),
    (ClampsOversizedEvict, "evict_beyond_evictable_raises"),
    (SplitCorruptsValues, "split_keeps_values_and_sizes"),
]


def _check_named(name: str, **options) -> kit.PrefixCacheCheck:
    return next(check for check in kit.prefix_cache_checks(**options) if check.name == name)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("broken", "check_name"), BROKEN_CACHES, ids=[cls.__name__ for cls, _ in BROKEN_CACHES])
def test_the_targeted_check_catches_a_broken_cache(broken, check_name, page_size):
    with pytest.raises(AssertionError, match=rf"check '{check_name}' failed \(page_size={page_size}"):
        _check_named(check_name).run(broken, page_size=page_size)


@pytest.mark.parametrize(("broken", "_"), BROKEN_CACHES, ids=[cls.__name__ for cls, _ in BROKEN_CACHES])
def test_the_randomised_check_alone_catches_a_broken_cache(broken, _):
    with pytest.raises(AssertionError, match="check 'randomised_differential' failed"):
        _check_named("randomised_differential").run(broken, page_size=4, shrink=False)


def test_check_prefix_cache_names_the_failing_check():
    with pytest.raises(AssertionError, match=r"prefix-cache check '\w+' failed \(page_size=1, device=cpu\)"):
        kit.check_prefix_cache(IgnoresLocks)


def test_a_cache_that_keeps_nothing_fails_the_full_suite_with_a_hint():
    with pytest.raises(AssertionError, match="keeps_entries=False"):
        kit.check_prefix_cache(naive_factory, page_sizes=(1,))


def test_a_factory_returning_the_wrong_type_is_reported():
    with pytest.raises(AssertionError, match="must return a kvplug.BasePrefixCache, got dict"):
        kit.check_prefix_cache(lambda config: {}, page_sizes=(1,))


# ------------------------------------------------------------------ the model's own eviction checks


def _model_with_two_sequences() -> ReferencePrefixCache:
    model = ReferencePrefixCache(page_size=2)
    model.insert([1, 1, 2, 2], [10, 11, 12, 13])  # two pages
    model.insert([3, 3], [20, 21])  # newer
    return model


@pytest.mark.parametrize(
    ("freed", "requested", "message"),
    [
        ([12], 1, "freed part of a page"),
        ([12, 13], 3, "freed only 2"),
        ([12, 13, 12], 1, "returned a location twice"),
        ([99, 98], 1, "never cached"),
        ([10, 11], 1, "freed a prefix but kept its extension"),
        ([20, 21], 1, "not least-recently-used first"),
    ],
)
def test_the_model_rejects_illegal_evictions(freed, requested, message):
    model = _model_with_two_sequences()
    with pytest.raises(AssertionError, match=message):
        model.apply_eviction(freed, requested)


def test_the_model_rejects_evicting_a_locked_entry_and_accepts_legal_ones():
    model = _model_with_two_sequences()
    model.lock([1, 1, 2, 2], +1)
    with pytest.raises(AssertionError, match="freed a locked entry"):
        model.apply_eviction([12, 13], 1)
    model.apply_eviction([20, 21], 1)  # the only unlocked entry
    assert model.sizes() == (0, 4)
    model.lock([1, 1, 2, 2], -1)
    model.apply_eviction([12, 13, 10, 11], 1)  # a whole branch, leaf and parent together
    assert model.sizes() == (0, 0) and model.match([1, 1]) == (0, [])


def test_the_model_matches_whole_pages_only():
    model = ReferencePrefixCache(page_size=2)
    assert model.insert([1, 1, 2, 2], [5, 6, 7, 8]) == 0
    assert model.match([1, 1, 2]) == (2, [5, 6])
    assert model.insert([1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 9, 9]) == 4
    assert model.locations([1, 1, 2, 2, 3, 3, 4]) == [5, 6, 7, 8, 9, 9]
    assert torch.equal(torch.tensor(model.leaf_keys()), torch.tensor([(1, 1, 2, 2, 3, 3)]))


def test_the_kit_is_an_attribute_of_kvplug_as_the_readme_writes_it():
    code = (
        "import kvplug; "
        "kvplug.testing.check_prefix_cache(lambda c: kvplug.create_prefix_cache('radix', page_size=c.page_size), "
        "page_sizes=(2,)); print('conforms')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "conforms", result.stderr
    with pytest.raises(AttributeError, match="no attribute 'tesitng'"):
        kvplug.tesitng  # noqa: B018


def test_a_missing_hypothesis_is_one_clear_error_before_any_check(monkeypatch):
    from kvplug.testing import dependencies

    real_find_spec = dependencies.importlib.util.find_spec
    monkeypatch.setattr(
        dependencies.importlib.util, "find_spec", lambda name, *a: None if name == "hypothesis" else real_find_spec(name, *a)
    )
    built = []

    def counting_factory(config):
        built.append(config)
        return radix_factory(config)

    with pytest.raises(kit.KitDependencyError, match=r"needs hypothesis, which is not installed: pip install 'hypothesis>=6.80'"):
        kit.check_prefix_cache(counting_factory, page_sizes=(1,))
    assert built == []  # refused up front: no check ran, none "failed"
    with pytest.raises(kit.KitDependencyError):
        kit.parametrize_prefix_cache_checks(page_sizes=(1,))
    kit.check_prefix_cache(counting_factory, page_sizes=(1,), randomised=False)  # the rest runs without it
    assert built
    assert "randomised_differential" not in {check.name for check in kit.prefix_cache_checks(randomised=False)}
