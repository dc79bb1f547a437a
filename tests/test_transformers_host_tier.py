"""The host-memory tier through the transformers host: generation is token-identical with the tier on
and off, on a pool small enough that prefixes are evicted (and so written back and loaded again)."""

from __future__ import annotations

import pytest
import torch

from tests.test_transformers_host import (  # noqa: F401  (fixtures)
    _generation_config,
    checkpoint,
    one_thread,
)

transformers = pytest.importorskip("transformers")
kvplug_transformers = pytest.importorskip("kvplug_transformers")
from kvplug_transformers.host import TransformersHost  # noqa: E402

# six 32-token prefixes (two pages of 16), asked in two rounds (two generate_batch calls on one
# persistent manager): by the second round the other prefixes have pushed each out of an 8-page
# pool, so it is found in host memory (tier on) or recomputed (tier off)
PREFIXES = [[1, *((7 * i + 3 * j) % 97 + 3 for j in range(31))] for i in range(6)]
ROUNDS = [[[*prefix, 100 + i] for i, prefix in enumerate(PREFIXES)],
          [[*prefix, 110 + i, 120] for i, prefix in enumerate(PREFIXES)]]
TIER_PROMPTS = ROUNDS[0] + ROUNDS[1]


def _generate(model, host, **settings):
    cb_config = transformers.ContinuousBatchingConfig(max_batch_tokens=40)
    tokens = []
    with host.installed_context(**settings):
        try:
            for prompts in ROUNDS:
                outputs = model.generate_batch(prompts, generation_config=_generation_config(),
                                               continuous_batching_config=cb_config, persistent_manager=True)
                results = list(outputs.values())
                assert len(results) == len(prompts) and all(result.error is None for result in results)
                tokens += [result.generated_tokens for result in results]
        finally:
            model.destroy_cached_continuous_batching_manager()
    return tokens, host.stats()


@pytest.mark.parametrize(("page_size", "num_pages"), [(16, 8), (1, 128)])
def test_tier_on_and_off_give_the_same_tokens_and_the_tier_is_used(checkpoint, page_size, num_pages):  # noqa: F811
    model, _ = checkpoint
    with torch.no_grad():
        references = [model.generate(torch.tensor([prompt]), generation_config=_generation_config())[0, len(prompt):]
                      .tolist() for prompt in TIER_PROMPTS]
    outputs = {}
    for host_memory in (None, "4MiB"):
        host = TransformersHost(max_seq_len=128, num_pages=num_pages, page_size=page_size, max_running_reqs=4)
        outputs[host_memory] = _generate(model, host, prefix_cache="radix", host_memory=host_memory)
    (off_tokens, off_stats), (on_tokens, on_stats) = outputs[None], outputs["4MiB"]
    assert off_tokens == references and on_tokens == references
    assert off_stats.host_write_backs == off_stats.host_hit_tokens == 0
    assert on_stats.evicted_tokens > 0 and on_stats.host_write_backs > 0 and on_stats.host_written_bytes > 0
    assert on_stats.host_hit_tokens > 0 and on_stats.host_loads > 0  # prefixes came back from host memory
    assert on_stats.cache_hit_tokens > off_stats.cache_hit_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("page_size", "num_pages"), [(16, 8), (1, 128)])
def test_cuda_tier_serves_generates_tokens_through_paced_write_backs_and_loads(checkpoint, page_size, num_pages):  # noqa: F811
    """On the GPU (fp32, decode graphs and the overlap on, as by default): write-backs through the
    paced copy worker, loads through the copy stream, tokens equal to ``generate``'s."""
    model, _ = checkpoint
    with torch.no_grad():
        references = [model.generate(torch.tensor([prompt]), generation_config=_generation_config())[0, len(prompt):]
                      .tolist() for prompt in TIER_PROMPTS]
    model.to("cuda")
    try:
        host = TransformersHost(max_seq_len=128, num_pages=num_pages, page_size=page_size, max_running_reqs=4)
        tokens, stats = _generate(model, host, prefix_cache="radix", host_memory="4MiB", attention="torch")
    finally:
        model.to("cpu")
    assert tokens == references
    assert stats.host_write_backs > 0 and stats.host_loads > 0 and stats.host_hit_tokens > 0


class SlowCopy:
    """Stands for a host -> device copy still in flight: ``query`` says not done for the first
    ``polls`` calls (the bytes are already there: the CPU pool copied them), ``synchronize`` ends it.
    Records how the host used it."""

    def __init__(self, polls: int) -> None:
        self.polls_left = polls
        self.queries = self.waits = self.synchronized = 0

    def query(self) -> bool:
        self.queries += 1
        if self.polls_left:
            self.polls_left -= 1
            return False
        return True

    def wait(self, stream=None) -> None:
        self.waits += 1

    def synchronize(self) -> None:
        self.synchronized += 1
        self.polls_left = 0


@pytest.mark.parametrize(("defer", "polls"), [(True, 1), (True, 3), (True, 1000), (False, 1000)])
def test_loads_still_copying_are_ordered_before_their_steps_and_tokens_stay_exact(checkpoint, monkeypatch, defer, polls):  # noqa: F811
    """Loads that are still copying when the scheduler looks (``polls`` checks, 1000: until nothing
    else can run). Deferred: the request is kept out of the steps, joins once the copy is done (or
    the scheduler waits for it when nothing else runs). Not deferred: it joins at once and its
    first step is ordered after the copy. Every token equals ``generate``'s."""
    from kvplug.interface import HostLoad
    from kvplug.prefix_cache.tiered_radix import TieredRadixPrefixCache

    model, _ = checkpoint
    with torch.no_grad():
        references = [model.generate(torch.tensor([prompt]), generation_config=_generation_config())[0, len(prompt):]
                      .tolist() for prompt in TIER_PROMPTS]
    copies: list[SlowCopy] = []
    start_host_load = TieredRadixPrefixCache.start_host_load

    def slow_start_host_load(cache, host_handle, device_indices):
        load = start_host_load(cache, host_handle, device_indices)
        assert load.done is None  # the CPU pool copies at once
        copies.append(SlowCopy(polls))
        slow = HostLoad(load.handle, copies[-1])
        for node, in_flight in list(cache._host_tier._in_flight.items()):
            assert in_flight is not slow
        for node in _loaded_nodes(cache, load.handle, device_indices.shape[0]):
            cache._host_tier._in_flight[node] = slow
        return slow

    monkeypatch.setattr(TieredRadixPrefixCache, "start_host_load", slow_start_host_load)
    host = TransformersHost(max_seq_len=128, num_pages=8, page_size=16, max_running_reqs=4)
    tokens, stats = _generate(model, host, prefix_cache="radix", host_memory="4MiB", defer_host_loads=defer)
    assert tokens == references
    assert stats.host_loads == len(copies) > 0 and stats.host_hit_tokens > 0
    assert all(copy.queries > 0 for copy in copies)  # every hit was checked at admission
    if defer and polls == 1000:  # nothing else could run at some point: the scheduler waited for the copy
        assert sum(copy.synchronized for copy in copies) > 0
    if not defer:  # joined at once: each step over a loading request waited for its copy
        assert all(copy.waits > 0 and copy.synchronized == 0 for copy in copies)
    assert all(copy.polls_left == 0 or copy.waits > 0 for copy in copies)  # never read before ordered


def _loaded_nodes(cache, handle, loaded_tokens):
    """The nodes at the end of ``handle``'s path that hold its last ``loaded_tokens`` tokens."""
    nodes, node = [], handle
    while loaded_tokens > 0:
        nodes.append(node)
        loaded_tokens -= node.num_tokens
        node = node.parent
    return nodes


def test_host_memory_setting_is_validated():
    from kvplug.interface import InvalidArgumentError
    from kvplug_transformers.settings import KVPlugSettings

    assert KVPlugSettings(host_memory="2GiB").host_memory == "2GiB"
    assert KVPlugSettings().host_memory is None
    for bad in ("lots", 0, -1, True):
        with pytest.raises(InvalidArgumentError):
            KVPlugSettings(host_memory=bad)
