"""Namespaces at engine level (vLLM 0.32.0's CPU build, issue 26): prompts under different LoRA
adapters, ``cache_salt`` values or prompt embeddings never share kvplug's pages, the same one twice
does. Real ``LLM(...)`` engines on the tiny random model (``tests/test_vllm_host``'s runner), one
request at a time, token ids compared with native vLLM (its own prefix caching on), KV events on:
kvplug publishes native vLLM's block hashes, which differ by adapter. The LoRA adapters are PEFT
directories written here (``tests/vllm_models.build_lora``, no peft needed). About a minute.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test-vllm-host.sh builds its environment)")
pytest.importorskip("kvplug_vllm", reason="kvplug-vllm is not installed (pip install -e adapters/vllm)")

from tests.test_vllm_host import model_dir, run_engine  # noqa: E402, F401
from tests.test_vllm_kv_events import replay  # noqa: E402
from tests.vllm_models import build_lora  # noqa: E402

WHOLE_BLOCKS = 256  # a 300-token prompt: two whole 128-token blocks, the last token recomputed


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("vllm-lora")
    return {"inputs": {"adapters": {name: str(build_lora(root / name, seed)) for name, seed in (("a", 1), ("b", 2))}}}


def by_label(result: dict) -> dict:
    return {step["label"]: step for step in result["steps"]}


def stored(result: dict) -> list:
    return [event for batch in result["events"] for event in batch if event["type"] == "BlockStored"]


def test_lora_adapters_and_salts_never_share_pages(model_dir: Path, tmp_path: Path, adapters: dict) -> None:  # noqa: F811
    """One prompt under no adapter, adapter a and adapter b (each twice), then under two salts: every
    output is native vLLM's; each adapter changes the output; the second request under an adapter
    hits its first's pages, the first under another adapter or salt hits nothing; the published
    blocks are native vLLM's, a hash chain per adapter, with its LoRA id and name."""
    native = run_engine(model_dir, "lora", "native", tmp_path, events=True, **adapters)
    ours = run_engine(model_dir, "lora", "radix", tmp_path, events=True, **adapters)
    assert [s["tokens"] for s in ours["steps"]] == [s["tokens"] for s in native["steps"]]
    assert [s["cached"] for s in ours["steps"]] == [s["cached"] for s in native["steps"]]
    steps = by_label(ours)
    assert len({tuple(steps[f"{name}-1"]["tokens"]) for name in ("base", "a", "b")}) == 3  # the adapters act
    for name in ("base", "a", "b"):
        assert steps[f"{name}-1"]["cached"] == 0 and steps[f"{name}-2"]["cached"] == WHOLE_BLOCKS
        assert steps[f"{name}-1"]["tokens"] == steps[f"{name}-2"]["tokens"]
    salted = [steps[label]["cached"] for label in ("tenant-a-1", "tenant-b-1", "tenant-a-2")]
    assert salted == [0, 0, WHOLE_BLOCKS]  # a salt shares nothing with the unsalted prompt or another salt
    assert all(steps[label]["tokens"] == steps["base-1"]["tokens"] for label in ("tenant-a-1", "tenant-b-1"))
    stats = ours["kvplug"]
    assert stats["hit_tokens"] == sum(s["cached"] for s in ours["steps"]) == 4 * WHOLE_BLOCKS
    assert stats["namespaces"] == 5 and ours["unmatched_pages"] == 0 and ours["pool_hash_entries"] == 0

    events = stored(ours)
    assert events == stored(native) and len(events) == 5  # each namespace's two blocks, once
    assert [(e["lora_id"], e["lora_name"]) for e in events] == [(None, None), (1, "a"), (2, "b"), (None, None),
                                                                 (None, None)]
    assert all(e["parent_block_hash"] is None and len(e["block_hashes"]) == 2 for e in events)
    assert len({h for e in events for h in e["block_hashes"]}) == 10  # equal token ids, five hash chains
    assert replay(ours["events"]) == {}  # the reset cleared every block held


def test_prompt_embeds_share_pages_only_when_identical(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """Prompts of 300 embeddings (placeholder token ids all equal): a second, different one hits
    nothing, the first again hits; one sharing only the first's first block hits nothing in kvplug
    (its namespace is the digest of all its embeddings; vLLM shares that block), the first's token
    ids as a token prompt hit nothing either; outputs are native vLLM's."""
    native = run_engine(model_dir, "embeds", "native", tmp_path, events=True)
    ours = run_engine(model_dir, "embeds", "radix", tmp_path, events=True)
    assert [s["tokens"] for s in ours["steps"]] == [s["tokens"] for s in native["steps"]]
    steps, natives = by_label(ours), by_label(native)
    assert steps["first"]["tokens"] != steps["second"]["tokens"]
    assert steps["first-again"]["tokens"] == steps["first"]["tokens"] == steps["first-as-tokens"]["tokens"]
    assert [steps[label]["cached"] for label in ("first", "second", "first-again", "shares-a-block",
                                                  "first-as-tokens")] == [0, 0, WHOLE_BLOCKS, 0, 0]
    assert natives["shares-a-block"]["cached"] == 128 and natives["first-again"]["cached"] == WHOLE_BLOCKS
    stats = ours["kvplug"]
    assert stats["hit_tokens"] == WHOLE_BLOCKS and stats["namespaces"] == 4 and ours["unmatched_pages"] == 0

    # native's hashes for the same blocks: the shared block is published once, by the first holder
    ours_blocks = {h: e["token_ids"] for e in stored(ours) for h in e["block_hashes"]}
    native_blocks = {h for e in stored(native) for h in e["block_hashes"]}
    assert set(ours_blocks) == native_blocks and len(native_blocks) == 7
    assert replay(ours["events"]) == {}
