"""The transformers adapter's table of internals (``kvplug_transformers.compat.INTERNALS``).

Each entry's fingerprint matches the installed (pinned) transformers; the version gate notices a
changed signature, a moved tuple position, a changed source or a missing name and names the
entry; the adapter README shows the same table; the installer replaces exactly the ``patched``
entries and restores them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
compat = pytest.importorskip("kvplug_transformers.compat")

README = Path(__file__).resolve().parents[1] / "adapters" / "transformers" / "README.md"
pinned = pytest.mark.skipif(transformers.__version__ != compat.PINNED_VERSION,
                            reason=f"fingerprints are of transformers {compat.PINNED_VERSION}")


def _entry(attribute: str, kind: str) -> compat.Internal:
    return next(entry for entry in compat.INTERNALS if entry.attribute == attribute and entry.kind == kind)


@pinned
@pytest.mark.parametrize("entry", compat.INTERNALS, ids=lambda entry: f"{entry.kind}:{entry.short_name}")
def test_fingerprint_of_the_pinned_release(entry):
    assert compat.fingerprint(entry) == entry.fingerprint


def test_entries_are_well_formed_and_unique():
    keys = [(entry.owner, entry.attribute, entry.kind) for entry in compat.INTERNALS]
    assert len(set(keys)) == len(keys)
    for entry in compat.INTERNALS:
        assert entry.owner.startswith("transformers.") and entry.attribute and entry.why
        assert entry.kind in compat.KINDS
        assert entry.check in (compat.PARAMETERS, compat.SOURCE, compat.RETURNS, compat.ASSIGNED, compat.FIELDS,
                               compat.INTERFACE, compat.MEMBERS)
    # the tuple position the scheduler wrapper reads (result[0]) is covered
    assert _entry("_process_candidates", compat.READ).fingerprint.startswith("(scheduled_requests,")
    # the re-implemented tail of the forward is guarded by its source
    assert _entry("_forward_process_and_sample", compat.REIMPLEMENTED).check == compat.SOURCE


def test_readme_shows_the_generated_table():
    text = README.read_text(encoding="utf-8")
    found = re.search(r"<!-- kvplug-internals:begin -->\n(.*?)\n<!-- kvplug-internals:end -->", text, re.S)
    assert found, "the adapter README lost its internals table markers"
    assert found.group(1) == compat.internals_table_markdown(), (
        "adapters/transformers/README.md's table differs from compat.INTERNALS; paste "
        "compat.internals_table_markdown() between the markers")
    patched = [entry for entry in compat.INTERNALS if entry.kind == compat.PATCHED]
    assert f"{['One', 'Two', 'Three', 'Four', 'Five', 'Six', 'Seven', 'Eight', 'Nine'][len(patched) - 1]} attributes are replaced" \
        in " ".join(text.split())


@pinned
def test_gate_passes_on_the_pinned_release():
    modules = compat.require_transformers()
    assert modules.version == compat.PINNED_VERSION


@pinned
def test_the_cache_integration_gate_never_imports_the_http_server(monkeypatch):
    """Without transformers' [serve] extras its server modules fail to import (a NameError in
    5.17.0): the host install checks the cache internals only; ``kvplug serve`` checks both."""
    from kvplug import host_internals

    resolve = host_internals.resolve

    def without_server(path):
        if path.startswith("transformers.cli.serving."):
            raise NameError("name 'CompletionCreateParamsStreaming' is not defined")
        return resolve(path)

    monkeypatch.setattr(host_internals, "resolve", without_server)
    assert any(compat.serving_internal(entry) for entry in compat.INTERNALS)
    assert compat.require_transformers().version == compat.PINNED_VERSION
    with pytest.raises(NameError):
        compat.require_transformers(serving=True)


def _scheduler():
    from transformers.generation.continuous_batching import scheduler

    return scheduler.Scheduler


@pinned
def test_a_changed_signature_is_refused_naming_the_entry(monkeypatch):
    def add_waiting_request(self, state, priority):  # a parameter more than 5.17.0's
        raise AssertionError("never called")

    monkeypatch.setattr(_scheduler(), "add_waiting_request", add_waiting_request)
    with pytest.raises(compat.UnsupportedTransformersError) as caught:
        compat.require_transformers()
    message = str(caught.value)
    assert "scheduler.Scheduler.add_waiting_request (patched" in message
    assert "expected 'self, state', found 'self, state, priority'" in message
    assert message.count("\n- ") == 1 and "changed 1 internal(s)" in message  # nothing else drifted


@pinned
def test_a_moved_tuple_position_is_refused(monkeypatch):
    def _process_candidates(self, candidates, token_budget, cache_budget, request_ids_to_remove_from_waiting):
        scheduled_requests, one_allocation_failed, decode_fast_path, num_q_tokens, max_kv_read = [], False, False, 0, 0
        return one_allocation_failed, scheduled_requests, decode_fast_path, num_q_tokens, max_kv_read

    monkeypatch.setattr(_scheduler(), "_process_candidates", _process_candidates)
    with pytest.raises(compat.UnsupportedTransformersError, match=r"Scheduler\._process_candidates \(read: position 0"):
        compat.require_transformers()


@pinned
def test_a_changed_source_of_the_reimplemented_function_is_refused(monkeypatch):
    from transformers.generation.continuous_batching import model_runner

    def _forward_process_and_sample(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids):
        self._sample(model(**batch_data).logits.float(), output_ids)  # same parameters, other body

    monkeypatch.setattr(model_runner.ModelRunner, "_forward_process_and_sample", _forward_process_and_sample)
    with pytest.raises(compat.UnsupportedTransformersError,
                       match=r"ModelRunner\._forward_process_and_sample \(re-implemented.*source expected"):
        compat.require_transformers()


@pinned
def test_missing_names_and_fields_are_refused_together(monkeypatch):
    from transformers.generation.continuous_batching import model_runner

    monkeypatch.delattr(model_runner.ModelRunner, "_sample")
    broken = _entry("RequestState", compat.READ)
    renamed = compat.Internal(broken.owner, broken.attribute, broken.kind, broken.why, broken.check,
                              broken.fingerprint.replace("initial_tokens", "prompt_tokens"))
    entries = (*[entry for entry in compat.INTERNALS if entry is not broken], renamed)
    with pytest.raises(compat.UnsupportedTransformersError) as caught:
        compat.check_internals(transformers.__version__, entries)
    message = str(caught.value)
    assert "3 internal(s)" in message and "ModelRunner._sample (called" in message and "ModelRunner._sample (patched" in message and "found 'missing'" in message
    assert "prompt_tokens (missing)" in message


@pinned
def test_install_replaces_exactly_the_patched_entries_and_uninstall_restores_them():
    from kvplug_transformers.host import TransformersHost
    from kvplug_transformers.installation import is_installed

    assert not is_installed()
    patched = [entry for entry in compat.INTERNALS if entry.kind == compat.PATCHED]
    owners = {entry.owner: compat.resolve(entry.owner) for entry in compat.INTERNALS}
    before = {entry.name: getattr(owners[entry.owner], entry.attribute) for entry in patched}
    with TransformersHost(prefix_cache="radix").installed_context():
        for entry in patched:
            replacement = getattr(owners[entry.owner], entry.attribute)
            assert replacement is not before[entry.name], entry.name
            assert getattr(replacement, compat.ORIGINAL_ATTRIBUTE) is before[entry.name], entry.name
        replaced = {f"{path}.{name}" for path, owner in owners.items() for name, value in vars(owner).items()
                    if hasattr(value, compat.ORIGINAL_ATTRIBUTE)}
        assert replaced == set(before)  # nothing replaced outside the table
        assert compat.drifted() == []  # the gate fingerprints the originals while installed
    for entry in patched:
        assert getattr(owners[entry.owner], entry.attribute) is before[entry.name], entry.name


@pinned
def test_a_drifted_release_installs_nothing(monkeypatch):
    from kvplug_transformers.host import TransformersHost
    from kvplug_transformers.installation import is_installed

    monkeypatch.setattr(_scheduler(), "add_waiting_request", lambda self, state, priority: None)
    cache_class = compat.resolve(f"{compat._CB}.continuous_api").PagedAttentionCache
    with pytest.raises(compat.UnsupportedTransformersError, match="add_waiting_request"):
        TransformersHost().install()
    assert not is_installed()
    assert compat.resolve(f"{compat._CB}.continuous_api").PagedAttentionCache is cache_class


@pinned
def test_the_native_sampler_replaces_only_sample_and_uninstall_restores_it():
    """``--kv-backend native``'s installation replaces one ``patched`` entry, ``ModelRunner._sample``,
    and a step goes to the active sampler with the original to call."""
    from kvplug_transformers.native_installation import install_native_sampler, is_installed, uninstall_native_sampler

    uninstall_native_sampler()  # an in-process native server of an earlier test leaves it until its stop
    owners = {entry.owner: compat.resolve(entry.owner) for entry in compat.INTERNALS}
    before = {f"{path}.{name}": value for path, owner in owners.items() for name, value in vars(owner).items()}
    runner_class = owners[f"{compat._CB}.model_runner.ModelRunner"]
    original = runner_class._sample
    seen = []

    class Sampler:
        def sample(self, runner, scores, output_ids, call_through):
            seen.append(call_through)

    install_native_sampler(Sampler())
    try:
        assert is_installed() and getattr(runner_class._sample, compat.ORIGINAL_ATTRIBUTE) is original
        after = {f"{path}.{name}": value for path, owner in owners.items() for name, value in vars(owner).items()}
        assert {name for name in after if after[name] is not before.get(name)} == {f"{compat._CB}.model_runner.ModelRunner._sample"}
        runner_class._sample(object(), None, None)
        assert seen == [original]
    finally:
        uninstall_native_sampler()
    assert runner_class._sample is original and not is_installed()
