"""kvplug-vllm without an engine: the version gate, the drift check over every vLLM private name the
adapter touches, the connector's configuration errors, and the block-level prefix cache against a
model of vLLM's reference counts (property-based)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test-vllm-host.sh builds its environment)")
compat = pytest.importorskip("kvplug_vllm.compat", reason="kvplug-vllm is not installed (pip install -e adapters/vllm)")

from hypothesis import given, settings, strategies as st  # noqa: E402

import kvplug  # noqa: E402
from kvplug.interface import InvalidArgumentError  # noqa: E402
from kvplug_vllm.block_cache import BlockPrefixCache  # noqa: E402
from kvplug_vllm.settings import parse_settings  # noqa: E402

README = Path(__file__).resolve().parents[1] / "adapters" / "vllm" / "README.md"


def test_installed_vllm_matches_every_fingerprint() -> None:
    assert compat.installed_vllm_version() in compat.SUPPORTED_VERSIONS
    assert compat.drifted() == []
    assert compat.require_supported_vllm() == compat.PINNED_VERSION


def test_a_drifted_internal_is_named_in_one_error() -> None:
    entry = compat.INTERNALS[0]
    changed = compat.Internal(entry.owner, entry.attribute, entry.kind, entry.why, entry.check, "self, other")
    gone = compat.Internal(entry.owner, "no_such_method", entry.kind, entry.why, compat.PARAMETERS, "self")
    with pytest.raises(compat.UnsupportedVLLMError) as error:
        compat.check_internals("0.32.0", (changed, gone, compat.INTERNALS[1]))
    message = str(error.value)
    assert "2 internal(s)" in message and "get_computed_blocks" in message and "no_such_method" in message
    assert "found 'self, request'" in message and "found 'missing'" in message


def test_other_versions_are_refused_with_one_clear_error() -> None:
    with pytest.raises(compat.UnsupportedVLLMError, match=r"supports vLLM 0\.32\.0, found 0\.31\.2"):
        compat.check_version("0.31.2", env={})
    with pytest.raises(compat.UnsupportedVLLMError, match="not installed"):
        compat.check_version(None, env={})
    assert compat.check_version("0.33.0", env={compat.ALLOW_UNTESTED_ENV: "1"}) == "0.33.0"
    assert compat.check_version("0.32.0+cpu", env={}) == "0.32.0+cpu"  # how vLLM names its CPU build
    with pytest.raises(compat.UnsupportedVLLMError):
        compat.check_version("0.32.1+cpu", env={})


def test_readme_table_is_the_internals_table() -> None:
    assert compat.internals_table_markdown() in README.read_text()


def test_general_plugin_registration_is_idempotent() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvplug_vllm.vllm_plugin import register

    register()
    register()
    cls = KVConnectorFactory.get_connector_class_by_name("KvplugConnector")
    assert cls.__name__ == "KvplugConnector" and cls.__module__ == "kvplug_vllm.connector"


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"prefix_cache": "radix", "host_memory": "lots"}, "host_memory must be bytes or a size like"),
        ({"host_memory": "1GiB", "prefix_cache_options": {"host_memory": "1GiB"}}, "give host_memory once"),
        ({"prefix_cach": "radix"}, r"unknown kv_connector_extra_config key\(s\) \['prefix_cach'\]"),
        ({"prefix_cache": ""}, "prefix_cache must be a kvplug prefix-cache name"),
        ({"prefix_cache_options": ["x"]}, "prefix_cache_options must be a JSON object"),
    ],
)
def test_bad_settings_are_one_error(extra: dict, pattern: str) -> None:
    with pytest.raises(InvalidArgumentError, match=pattern):
        parse_settings(extra)


def test_unknown_cache_name_and_option_fail_naming_what_exists() -> None:
    from kvplug_vllm.connector import prefix_cache_factory

    with pytest.raises(kvplug.UnknownComponentError) as error:
        prefix_cache_factory(parse_settings({"prefix_cache": "nope"}), 128, 16)()
    assert "'nope'" in str(error.value) and "radix" in str(error.value) and "naive" in str(error.value)
    with pytest.raises(InvalidArgumentError, match="unknown_option"):
        prefix_cache_factory(parse_settings({"prefix_cache": "radix", "prefix_cache_options": {"unknown_option": 1}}),
                             128, 16)()


# ---------------------------------------------------------------------- BlockPrefixCache vs reference counts
class RefModel:
    """vLLM's side, reduced to what kvplug relies on: a reference count per block and a free set."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = [0] * num_blocks
        self.free = set(range(num_blocks))

    def take(self, ids) -> None:
        for block in ids:
            assert self.refs[block] > 0, "kvplug referenced a block no request holds"
            self.refs[block] += 1

    def drop(self, ids) -> None:
        for block in ids:
            assert self.refs[block] > 0
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.add(block)

    def allocate(self, count: int) -> list[int]:
        blocks = sorted(self.free)[:count]
        for block in blocks:
            self.free.discard(block)
            self.refs[block] = 1
        return blocks


@pytest.mark.parametrize("name", ["radix", "naive"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_block_cache_keeps_vllm_reference_counts_exact(name: str, data: st.DataObject) -> None:
    """Random requests allocate, hit, cache and free; kvplug's evictable blocks are always held by kvplug
    alone, evicting frees exactly what it reports, and every block is free, cached or in use."""
    block_size, num_blocks = 4, 24
    model = RefModel(num_blocks)
    cache = BlockPrefixCache(lambda: kvplug.create_prefix_cache(name, page_size=block_size), block_size,
                             model.take, model.drop)
    heads = [[7] * 8, [1, 2, 3, 4, 5, 6, 7, 8], [9] * 4]
    running: list[tuple] = []  # (namespace, tokens, blocks, locked match)
    for _ in range(data.draw(st.integers(1, 30))):
        if running and data.draw(st.booleans()):
            namespace, tokens, blocks, held = running.pop(data.draw(st.integers(0, len(running) - 1)))
            cache.insert(namespace, tokens, blocks)
            cache.unlock(held)
            model.drop(blocks)
            continue
        namespace = data.draw(st.sampled_from(["a", "b"]))
        tokens = data.draw(st.sampled_from(heads)) + data.draw(st.lists(st.integers(0, 9), max_size=9))
        match = cache.match(namespace, tokens, len(tokens) - 1)
        assert match.num_tokens % block_size == 0 and match.num_tokens <= len(tokens) - 1
        needed = len(tokens) // block_size - len(match.block_ids)
        cache.lock(match)
        shortage = needed - len(model.free)
        if shortage > 0:
            evictable, free_before = cache.evictable_blocks, len(model.free)
            freed = cache.evict_blocks(shortage)
            # at least the shortage (all there was, when less), each evicted block now free
            assert freed >= min(shortage, evictable) and len(model.free) == free_before + freed
            assert cache.evictable_blocks == evictable - freed
        if needed > len(model.free):
            cache.unlock(match)
            continue
        model.take(match.block_ids) if match.block_ids else None
        blocks = list(match.block_ids) + model.allocate(needed)
        running.append((namespace, tokens, blocks, match))
        # conservation: free + (blocks referenced) == all, and cached-only blocks are evictable
        referenced = sum(1 for refs in model.refs if refs)
        assert len(model.free) + referenced == num_blocks
        only_kvplug = {block for block in range(num_blocks) if model.refs[block] == 1} - {
            block for _, _, held_blocks, _ in running for block in held_blocks}
        assert len(only_kvplug) == cache.evictable_blocks
        cache.check_integrity()
    for namespace, tokens, blocks, held in running:
        cache.unlock(held)
        model.drop(blocks)
    assert cache.reset()
    assert len(model.free) == num_blocks and not any(model.refs)


def test_namespaces_separate_lora_salt_and_multimodal_inputs() -> None:
    from types import SimpleNamespace as NS

    from kvplug_vllm.namespaces import DEFAULT_NAMESPACE, namespace_of

    def request(lora=None, salt=None, features=()):
        return NS(lora_request=lora, cache_salt=salt, mm_features=list(features))

    image = NS(identifier="img-1", mm_position=NS(offset=5))
    other_image = NS(identifier="img-2", mm_position=NS(offset=5))
    spaces = {
        namespace_of(request()),
        namespace_of(request(lora=NS(lora_int_id=1, lora_name="a", lora_path="/a"))),
        namespace_of(request(lora=NS(lora_int_id=2, lora_name="b", lora_path="/b"))),
        # the same name re-pointed at other weights (vLLM's hash keys name and path)
        namespace_of(request(lora=NS(lora_int_id=1, lora_name="a", lora_path="/a-v2"))),
        namespace_of(request(salt="tenant-a")),
        namespace_of(request(features=[image])),
        namespace_of(request(features=[other_image])),
        namespace_of(request(features=[NS(identifier="img-1", mm_position=NS(offset=9))])),
    }
    assert len(spaces) == 8 and namespace_of(request()) == DEFAULT_NAMESPACE
    assert namespace_of(request(features=[image])) == namespace_of(request(features=[image]))

    # prompts given as embeddings: placeholder token ids, so the embeddings themselves separate them
    import torch

    def embedded(values):
        return NS(lora_request=None, cache_salt=None, mm_features=[], prompt_embeds=torch.tensor(values))

    first, same, other = embedded([[0.5, 1.0]]), embedded([[0.5, 1.0]]), embedded([[0.5, 2.0]])
    assert namespace_of(first) == namespace_of(same) != namespace_of(other) != DEFAULT_NAMESPACE
    assert namespace_of(embedded([[0.5, 1.0, 0.0]])) != namespace_of(first)
    assert namespace_of(NS(lora_request=None, cache_salt=None, mm_features=[], prompt_embeds=None)) == DEFAULT_NAMESPACE

    model = RefModel(8)
    cache = BlockPrefixCache(lambda: kvplug.create_prefix_cache("radix", page_size=4), 4, model.take, model.drop)
    tokens = list(range(9))
    blocks = model.allocate(2)
    cache.insert(namespace_of(request(salt="tenant-a")), tokens, blocks)
    assert cache.match(namespace_of(request(salt="tenant-a")), tokens, 8).block_ids == tuple(blocks)
    for other in spaces - {namespace_of(request(salt="tenant-a"))}:
        assert cache.match(other, tokens, 8).num_tokens == 0
