"""A third-party prefix cache that faults inside vLLM 0.32.0 is quarantined (issue 32): vLLM keeps serving.

Two levels:

- ``BlockPrefixCache`` over a model of vLLM's reference counts (``test_vllm_compat.RefModel``), with
  every fault of ``tests.faulty_cache`` (raise, exit, locations outside the pool or twice, lengths
  that lie, short evictions, sizes that lie) injected after a random number of calls: every block
  stays free, cached or in use, and all are free once the requests are done and the cache is reset.
- ``LLM(...)`` engines on the vLLM CPU build (``tests/vllm_llm_run.py``, the fixtures of
  ``test_vllm_host``) with ``prefix_cache: faulty``: token ids identical to native vLLM, block
  conservation checked after every scheduling step, the quarantine in the connector's stats.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test-vllm-host.sh builds its environment)")
pytest.importorskip("kvplug_vllm", reason="kvplug-vllm is not installed (pip install -e adapters/vllm)")

from hypothesis import given, settings, strategies as st  # noqa: E402

import kvplug  # noqa: E402
from kvplug.prefix_cache.checked import CheckedPrefixCache  # noqa: E402
from kvplug_vllm.block_cache import BlockPrefixCache  # noqa: E402

from tests.faulty_cache import FaultyCachePlugin, all_faults  # noqa: E402
from tests.test_vllm_compat import RefModel  # noqa: E402
from tests.test_vllm_host import model_dir, run_engine  # noqa: E402,F401  (the module's model fixture)

BLOCK, NUM_BLOCKS = 4, 24


def faulty_cache(fault: str, after: int, model: RefModel, policy: str = "fallback") -> BlockPrefixCache:
    manager = kvplug.PluginManager(entry_points=False)
    manager.register(FaultyCachePlugin(), "faulty-cache-vllm-tests")

    def factory():
        inner = manager.create_prefix_cache("faulty", device="cpu", page_size=BLOCK, fault=fault, after=after)
        return CheckedPrefixCache(inner, num_pages=NUM_BLOCKS, page_size=BLOCK, name="faulty")

    return BlockPrefixCache(factory, BLOCK, model.take, model.drop, name="faulty", on_cache_failure=policy)


class HypothesisChoices:
    def __init__(self, data: st.DataObject) -> None:
        self.draw = data.draw

    def integer(self, low: int, high: int) -> int:
        return self.draw(st.integers(low, high))

    def choice(self, options: list):
        return self.draw(st.sampled_from(options))

    def tail(self) -> list[int]:
        return self.draw(st.lists(st.integers(0, 9), max_size=9))


class RandomChoices:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def choice(self, options: list):
        return self.rng.choice(options)

    def tail(self) -> list[int]:
        return [self.rng.randrange(10) for _ in range(self.rng.randrange(10))]


def adopt(model: RefModel, block_ids) -> None:
    """vLLM's ``BlockPool.touch`` of an admitted hit (``allocate_slots`` does it before allocating):
    a block without a reference (kvplug's was dropped by a quarantine) leaves the free queue."""
    for block in block_ids:
        if model.refs[block] == 0:
            model.free.discard(block)
        model.refs[block] += 1


def lifecycle(cache: BlockPrefixCache, model: RefModel, pick) -> None:
    """Requests as ``prefix_caching.RequestPrefixes`` drives them: match, lock the hit, make room,
    adopt the hit's blocks, cache the whole blocks, move the lock onto them, finish."""
    heads = [[7] * 8, [1, 2, 3, 4, 5, 6, 7, 8], [9] * 4]
    running: list[tuple] = []  # (namespace, tokens, blocks, what the lock holds)
    for _ in range(pick.integer(1, 30)):
        if running and pick.choice([True, False]):
            namespace, tokens, blocks, held = running.pop(pick.integer(0, len(running) - 1))
            inserted = cache.insert(namespace, tokens, blocks)
            locked = cache.lock(inserted)
            cache.unlock(held)
            cache.unlock(locked)
            model.drop(blocks)
        else:
            namespace = pick.choice(["a", "b"])
            tokens = pick.choice(heads) + pick.tail()
            match = cache.match(namespace, tokens, len(tokens) - 1)
            assert match.num_tokens % BLOCK == 0 and match.num_tokens <= len(tokens) - 1
            assert len(set(match.block_ids)) == len(match.block_ids) and all(0 <= b < NUM_BLOCKS for b in match.block_ids)
            held = cache.lock(match)
            needed = len(tokens) // BLOCK - len(match.block_ids)
            adopt(model, match.block_ids)
            shortage = needed - len(model.free)
            if shortage > 0:
                cache.evict_blocks(shortage)
            if needed > len(model.free):
                cache.unlock(held)
                model.drop(match.block_ids)
                continue
            running.append((namespace, tokens, list(match.block_ids) + model.allocate(needed), held))
        evictable = cache.evictable_blocks  # first: a fault here hands blocks back to the model
        referenced = sum(1 for refs in model.refs if refs)
        assert len(model.free) + referenced == NUM_BLOCKS
        in_use = {block for _, _, blocks, _ in running for block in blocks}
        only_kvplug = {block for block in range(NUM_BLOCKS) if model.refs[block] == 1} - in_use
        assert len(only_kvplug) == evictable  # what vLLM counts as free is freeable
        assert cache.cached_tokens // BLOCK <= referenced
        cache.check_integrity()
    for _, _, blocks, held in running:
        cache.unlock(held)
        model.drop(blocks)
    assert cache.protected_tokens == 0 and cache.quarantine.locked_blocks == 0
    assert cache.reset()
    assert len(model.free) == NUM_BLOCKS and not any(model.refs)


@pytest.mark.parametrize("fault", all_faults())
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_a_faulty_plugin_is_quarantined_and_blocks_stay_conserved(fault: str, data: st.DataObject) -> None:
    model = RefModel(NUM_BLOCKS)
    cache = faulty_cache(fault, data.draw(st.integers(0, 12)), model)
    lifecycle(cache, model, HypothesisChoices(data))
    if cache.quarantine.failures:
        assert cache.name == "naive" and cache.quarantine.as_dict()["quarantined_prefix_cache"] == "faulty"
        assert cache.quarantine.last_fault.startswith("prefix cache 'faulty': ")
    else:
        assert cache.name == "faulty"


def test_every_fault_is_met_at_least_once() -> None:
    """The parametrized test above is not vacuous: each fault trips the quarantine in some lifecycle."""
    for fault in all_faults():
        for seed in range(40):
            model = RefModel(NUM_BLOCKS)
            cache = faulty_cache(fault, seed % 4, model)
            lifecycle(cache, model, RandomChoices(seed))
            if cache.quarantine.failures:
                break
        else:
            raise AssertionError(f"fault {fault!r} never tripped the quarantine")


def test_a_locked_prefix_keeps_its_blocks_until_its_request_releases_it() -> None:
    """A hit locked at admission, before vLLM took its reference, survives a quarantine in between;
    an unlocked entry's block goes back to vLLM's free queue at once."""
    model = RefModel(NUM_BLOCKS)
    cache = faulty_cache("lock_handle:raise", 1, model)
    tokens, other = list(range(9)), [9] * 5
    blocks, other_block = model.allocate(2), model.allocate(1)
    cache.insert("a", tokens, blocks)
    cache.insert("a", other, other_block)
    model.drop(blocks + other_block)  # the requests that computed them finished: kvplug alone holds them
    match = cache.match("a", tokens, 8)
    held = cache.lock(match)  # admitted: locked, vLLM's reference not taken yet
    assert match.block_ids == tuple(blocks) and held is match
    other_match = cache.match("a", other, 4)
    assert cache.lock(other_match).num_tokens == 0  # the plugin raises: quarantined, nothing locked
    assert cache.quarantine.failures == 1 and cache.quarantine.locked_blocks == 2
    assert model.refs[other_block[0]] == 0 and other_block[0] in model.free
    assert all(model.refs[block] == 1 for block in blocks) and not cache.reset()  # kept, not freed
    adopt(model, match.block_ids)
    cache.unlock(held)
    assert cache.quarantine.locked_blocks == 0 and all(model.refs[block] == 1 for block in blocks)
    assert cache.match("a", tokens, 8).num_tokens == 0 and cache.name == "naive"  # no more hits
    model.drop(blocks)
    assert cache.reset() and len(model.free) == NUM_BLOCKS


def test_on_cache_failure_is_read_from_the_extra_config_and_checked() -> None:
    from kvplug.interface import InvalidArgumentError
    from kvplug_vllm.settings import parse_settings

    assert parse_settings({}).on_cache_failure == "fallback"
    assert parse_settings({"on_cache_failure": "fail"}).on_cache_failure == "fail"
    assert parse_settings({"on_cache_failure": "fallback"}).to_json()["on_cache_failure"] == "fallback"
    for bad in ("stop", "", None, 1):
        with pytest.raises(InvalidArgumentError) as error:
            parse_settings({"on_cache_failure": bad})
        assert str(error.value) == (f"KvplugConnector: on_cache_failure must be one of ['fallback', 'fail'], "
                                    f"got {bad!r}")


@pytest.mark.parametrize("fault", ["match_prefix:raise", "match_prefix:outside_pool", "lock_handle:raise",
                                   "insert_prefix:raise"])
def test_policy_fail_raises_the_fault_and_every_later_call(fault: str) -> None:
    """``on_cache_failure: "fail"``: no hand-over, no fallback; the call that met the fault raises a
    ``PrefixCacheFault`` naming the plugin, the call and the option (out of vLLM's scheduler: the
    engine dies), and so does every later call, the nested namespace creation counted once."""
    from kvplug.interface import PrefixCacheFault

    model = RefModel(NUM_BLOCKS)
    cache = faulty_cache(fault, 0, model, policy="fail")
    tokens = list(range(9))
    with pytest.raises(PrefixCacheFault) as stopped:
        for _ in range(4):
            blocks = model.allocate(2)
            cache.lock(cache.insert("a", tokens, blocks))
            cache.lock(cache.match("a", tokens, 8))
    message = str(stopped.value)
    method = fault.partition(":")[0]
    assert message.startswith("kvplug prefix cache 'faulty' failed in ")
    assert "and the engine stops (on_cache_failure='fail' in kv_connector_extra_config): " in message
    assert f"prefix cache 'faulty': {method}" in message and stopped.value.plugin == "faulty"
    assert isinstance(stopped.value.__cause__, PrefixCacheFault)
    record = cache.quarantine.as_dict()
    assert record == {"on_cache_failure": "fail", "cache_failures": 1, "last_cache_fault": record["last_cache_fault"],
                      "quarantined_prefix_cache": None, "stopped": True}
    assert record["last_cache_fault"].startswith(f"prefix cache 'faulty': {method}")
    assert cache.name == "faulty" and cache.quarantine.stopped is stopped.value
    for later in (lambda: cache.match("b", tokens, 8), lambda: cache.evictable_blocks, cache.reset,
                  lambda: cache.evict_blocks(1), cache.check_integrity):
        with pytest.raises(PrefixCacheFault) as again:
            later()
        assert again.value is stopped.value
    assert cache.quarantine.failures == 1


def test_policy_fallback_is_the_default_and_reports_itself() -> None:
    model = RefModel(NUM_BLOCKS)
    cache = faulty_cache("match_prefix:raise", 0, model)
    assert cache.match("a", list(range(9)), 8).num_tokens == 0  # quarantined, naive answered
    assert cache.quarantine.as_dict() == {"on_cache_failure": "fallback", "cache_failures": 1,
                                          "last_cache_fault": cache.quarantine.last_fault,
                                          "quarantined_prefix_cache": "faulty", "stopped": False}


# ---------------------------------------------------------------------- LLM(...) engines
ENGINE_FAULTS = [
    ("identity", "match_prefix:raise", 2),
    ("identity", "match_prefix:outside_pool", 2),
    ("identity", "match_prefix:twice", 2),
    ("identity", "match_prefix:long_cached_len", 2),
    ("identity", "lock_handle:raise", 1),
    ("identity", "insert_prefix:raise", 2),
    ("pressure", "evict:raise", 1),
]


@pytest.mark.parametrize(("workload", "fault", "after"), ENGINE_FAULTS)
def test_vllm_serves_through_a_faulty_plugin_token_identical(model_dir: Path, tmp_path: Path, workload: str,  # noqa: F811
                                                              fault: str, after: int) -> None:
    native = run_engine(model_dir, workload, "native", tmp_path)
    ours = run_engine(model_dir, workload, "faulty", tmp_path,
                      extra={"prefix_cache_options": {"fault": fault, "after": after}})
    assert ours["manager"] == "KvplugKVCacheManager"
    for round_ours, round_native in zip(ours["rounds"], native["rounds"]):
        assert round_ours["tokens"] == round_native["tokens"]
    if workload == "identity":
        assert ours["salted"]["tokens"] == native["salted"]["tokens"]
    stats = ours["kvplug"]  # conservation was checked after every step by the runner
    assert stats["cache_failures"] == 1 and stats["quarantined_prefix_cache"] == "faulty"
    assert stats["prefix_cache"] == "naive"
    method = fault.partition(":")[0]
    assert stats["last_cache_fault"].startswith(f"prefix cache 'faulty': {method}")
    assert ours["reset"] is True and ours["after_reset"]["free_blocks"] == ours["after_reset"]["num_blocks"] - 1
