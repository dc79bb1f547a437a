"""The table of vLLM internals the KVPLUG attention backend relies on
(``kvplug_vllm.attention_registration.ATTENTION_INTERNALS``).

Every fingerprint matches the installed vLLM when it is the pinned release; the check notices a
changed signature, a changed source, a missing name, a changed constant or a missing dataclass
field, and names the entry; the KVPLUG classes still match the signatures vLLM calls them with.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")
registration = pytest.importorskip("kvplug_vllm.attention_registration")
backend_module = pytest.importorskip("kvplug_vllm.attention_backend")

from kvplug import host_internals  # noqa: E402

Internal = registration.Internal
ADAPTER = Path(__file__).resolve().parents[1] / "adapters" / "vllm"
pinned = pytest.mark.skipif(vllm.__version__ != registration.PINNED_VLLM_VERSION,
                            reason=f"fingerprints are of vLLM {registration.PINNED_VLLM_VERSION}")


def _entry(attribute: str) -> Internal:
    return next(entry for entry in registration.ATTENTION_INTERNALS if entry.name.endswith("." + attribute))


@pinned
@pytest.mark.parametrize("entry", registration.ATTENTION_INTERNALS, ids=lambda entry: entry.name)
def test_fingerprint_of_the_pinned_release(entry):
    assert registration.fingerprint(entry) == entry.fingerprint


@pinned
def test_no_drift_on_the_pinned_release():
    assert registration.check_attention_internals() == ()
    registration.require_attention_internals()


def test_entries_are_well_formed_and_unique():
    names = [entry.name for entry in registration.ATTENTION_INTERNALS]
    assert len(set(names)) == len(names)
    for entry in registration.ATTENTION_INTERNALS:
        assert entry.owner.startswith("vllm.") and entry.attribute and entry.why and entry.fingerprint
        assert entry.check in host_internals.CHECKS and entry.kind
    # what the padding mapping and the graph support stand on is covered
    assert _entry("PAD_SLOT_ID").fingerprint == "-1" and _entry("NULL_BLOCK_ID").fingerprint == "0"
    assert "UNIFORM_SINGLE_TOKEN_DECODE" in _entry("AttentionCGSupport").fingerprint
    assert _entry("GPUModelRunner._build_attention_metadata").check == host_internals.SOURCE


@pinned
def test_a_changed_signature_is_refused_naming_the_entry(monkeypatch):
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    def build_for_cudagraph_capture(self, common_attn_metadata, num_padded):  # a parameter more
        raise AssertionError("never called")

    monkeypatch.setattr(AttentionMetadataBuilder, "build_for_cudagraph_capture", build_for_cudagraph_capture)
    with pytest.raises(registration.UnsupportedVllmAttentionError) as caught:
        registration.require_attention_internals()
    message = str(caught.value)
    assert "AttentionMetadataBuilder.build_for_cudagraph_capture (" in message and ": parameters expected" in message
    assert "found 'self, common_attn_metadata, num_padded'" in message
    assert message.count("\n- ") == 1 and "changed 1 internal(s)" in message


@pinned
def test_a_changed_source_a_constant_and_a_missing_name_are_reported_together(monkeypatch):
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends import utils

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        return selected_backend.get_path()  # the CPU platform honouring the selection: other source

    monkeypatch.setattr(CpuPlatform, "get_attn_backend_cls", classmethod(get_attn_backend_cls))
    monkeypatch.setattr(utils, "PAD_SLOT_ID", -2)
    monkeypatch.delattr(utils, "NULL_BLOCK_ID")
    problems = registration.check_attention_internals()
    assert len(problems) == 3
    assert any("CpuPlatform.get_attn_backend_cls (" in line and ": source expected" in line for line in problems)
    assert any("PAD_SLOT_ID (" in line and ": value expected" in line and "found '-2'" in line for line in problems)
    assert any("NULL_BLOCK_ID (" in line and "found 'missing'" in line for line in problems)


def test_a_missing_dataclass_field_is_reported():
    entry = _entry("CommonAttentionMetadata")
    renamed = dataclasses.replace(entry, fingerprint=entry.fingerprint.replace("slot_mapping", "slot_mappings"))
    (problem,) = registration.check_attention_internals([renamed])
    assert "CommonAttentionMetadata (" in problem and ": fields expected" in problem and "slot_mappings" in problem


def test_kvplug_classes_match_the_signatures_vllm_calls():
    from vllm.v1.attention.backend import AttentionImpl, AttentionMetadataBuilder

    def names(function):
        return list(inspect.signature(function).parameters)

    impl = backend_module.KvplugAttentionImpl
    assert names(impl.forward) == names(AttentionImpl.forward)
    assert names(impl.__init__)[: len(names(AttentionImpl.__init__))] == names(AttentionImpl.__init__)
    builder = backend_module.KvplugAttentionMetadataBuilder
    for method in ("__init__", "build", "build_for_cudagraph_capture"):
        assert names(getattr(builder, method)) == names(getattr(AttentionMetadataBuilder, method)), method
    assert builder.get_cudagraph_support(None, None).name == "UNIFORM_SINGLE_TOKEN_DECODE"
    assert [layout.name for layout in backend_module.KvplugAttentionBackend.supported_kv_cache_layouts()] == ["LBNHC"]


def test_the_adapter_docs_show_the_generated_table():
    table = registration.internals_table_markdown()
    assert table.count("\n") == len(registration.ATTENTION_INTERNALS) + 1
    docs = [path for path in (ADAPTER / "README.md", ADAPTER / "ATTENTION.md") if path.exists()]
    texts = [path.read_text(encoding="utf-8") for path in docs]
    found = [re.search(r"<!-- kvplug-attention-internals:begin -->\n(.*?)\n<!-- kvplug-attention-internals:end -->",
                       text, re.S) for text in texts]
    shown = [match.group(1) for match in found if match]
    assert shown, f"no kvplug-attention-internals markers in {[str(path) for path in docs]}"
    assert shown == [table] * len(shown), "paste internals_table_markdown() between the markers"
