"""The plugin contract: registration, validation, errors, entry-point loading and its variables."""

from __future__ import annotations

import importlib
import itertools
import re

import pluggy
import pytest
import torch

import kvplug
from kvplug.plugins import PluginLoadWarning, PluginManager
from kvplug.prefix_cache.naive import NaivePrefixCache
from tests.plugin_fixtures import SOURCES, make_distribution

_unique = itertools.count()


def isolated_manager(**env: str) -> PluginManager:
    return PluginManager(env=env)


class CachePlugin:
    """A plugin object registering one prefix cache under ``name``."""

    def __init__(self, name: str, factory=NaivePrefixCache) -> None:
        self.name, self.factory = name, factory

    @kvplug.hookimpl
    def kvplug_register_prefix_caches(self, register):
        register(self.name, self.factory)


def test_builtins_are_plugins_and_listed():
    manager = PluginManager(entry_points=False)
    assert {"naive", "radix"} <= set(manager.available("prefix_cache"))
    assert "mha" in manager.available("kv_pool")
    assert "torch" in manager.available("attention")
    builtin = [info for info in manager.plugins() if info.builtin]
    assert builtin and all(info.distribution == "kvplug" and info.version == kvplug.__version__ for info in builtin)
    assert manager.providers("prefix_cache")["naive"] == "kvplug.builtin.prefix_caches"


def test_unknown_kind_is_a_value_error():
    with pytest.raises(ValueError, match="prefix_cache"):
        PluginManager(entry_points=False).available("prefix_caches")


def test_unknown_name_lists_available_names_and_providers():
    manager = PluginManager(entry_points=False)
    with pytest.raises(kvplug.UnknownComponentError) as caught:
        manager.create_prefix_cache("radx")
    assert isinstance(caught.value, KeyError)
    message = str(caught.value)
    assert "'radx'" in message and "'naive' (from kvplug.builtin.prefix_caches)" in message and "'radix'" in message


def test_third_party_object_registers_and_creates_by_name():
    manager = PluginManager(entry_points=False)
    manager.register(CachePlugin("mine"), "my-plugin")
    cache = manager.create_prefix_cache("mine", page_size=4)
    assert isinstance(cache, NaivePrefixCache) and cache.page_size == 4
    assert manager.providers("prefix_cache")["mine"] == "my-plugin"
    manager.unregister("my-plugin")
    assert "mine" not in manager.available("prefix_cache")


def test_duplicate_name_names_both_plugins_and_changes_nothing():
    manager = PluginManager(entry_points=False)
    manager.register(CachePlugin("mine"), "first")
    before = {kind: manager.providers(kind) for kind in ("prefix_cache", "kv_pool", "attention", "host")}
    with pytest.raises(kvplug.DuplicateComponentError, match="kvplug.builtin.prefix_caches.*impostor"):
        manager.register(CachePlugin("naive"), "impostor")
    with pytest.raises(kvplug.DuplicateComponentError, match="'first'.*'second'"):
        manager.register(CachePlugin("mine"), "second")
    assert {kind: manager.providers(kind) for kind in before} == before
    assert {"impostor", "second"}.isdisjoint(info.name for info in manager.plugins())
    assert isinstance(manager.create_prefix_cache("naive"), NaivePrefixCache)
    # the refused name is free again once its first provider leaves
    manager.unregister("first")
    manager.register(CachePlugin("mine"), "second")
    assert manager.providers("prefix_cache")["mine"] == "second"


@pytest.mark.parametrize("failure", [RuntimeError("hook broken"), SystemExit(4)])
def test_a_failing_hook_is_refused_with_the_plugin_named(failure):
    class Failing:
        @kvplug.hookimpl
        def kvplug_register_prefix_caches(self, register):
            register("half-registered", NaivePrefixCache)
            raise failure

    manager = PluginManager(entry_points=False)
    with pytest.raises(kvplug.PluginRegistrationError, match="'failing'.*kvplug_register_prefix_caches") as caught:
        manager.register(Failing(), "failing")
    assert caught.value.__cause__ is failure
    assert manager.available("prefix_cache") == ["naive", "radix"]
    assert "failing" not in {info.name for info in manager.plugins()}


def test_misspelt_hook_argument_is_rejected_by_pluggy():
    class Misspelt:
        @kvplug.hookimpl
        def kvplug_register_prefix_caches(self, registr):
            pass

    manager = PluginManager(entry_points=False)
    with pytest.raises(pluggy.PluginValidationError, match="registr"):
        manager.register(Misspelt(), "misspelt")
    assert "misspelt" not in dict(manager.pluggy_manager.list_name_plugin())


def test_misspelt_hook_name_is_rejected():
    class WrongHook:
        @kvplug.hookimpl
        def kvplug_register_prefix_cache(self, register):
            pass

    manager = PluginManager(entry_points=False)
    with pytest.raises(pluggy.PluginValidationError, match="kvplug_register_prefix_cache"):
        manager.register(WrongHook(), "wrong-hook")
    assert manager.available("prefix_cache") == ["naive", "radix"]


def test_hook_may_omit_register_argument():
    class Quiet:
        @kvplug.hookimpl
        def kvplug_register_hosts(self):
            pass

    manager = PluginManager(entry_points=False)
    manager.register(Quiet(), "quiet")
    assert "quiet" in {info.name for info in manager.plugins()}


@pytest.mark.parametrize(
    "name, factory, message",
    [
        (3, NaivePrefixCache, "non-string name 3"),
        ("", NaivePrefixCache, "expected a non-empty name"),
        (" padded ", NaivePrefixCache, "expected a non-empty name"),
        ("a,b", NaivePrefixCache, "commas"),
        ("not-callable", 42, "not callable"),
    ],
)
def test_bad_registration_names_the_plugin(name, factory, message):
    manager = PluginManager(entry_points=False)
    with pytest.raises(kvplug.PluginRegistrationError, match=message) as caught:
        manager.register(CachePlugin(name, factory), "sloppy-plugin")
    assert "sloppy-plugin" in str(caught.value)
    assert manager.available("prefix_cache") == ["naive", "radix"]


def test_factory_returning_wrong_type_names_the_plugin():
    manager = PluginManager(entry_points=False)
    manager.register(CachePlugin("liar", lambda config: object()), "liar-plugin")
    with pytest.raises(kvplug.PluginRegistrationError, match="liar-plugin.*BasePrefixCache"):
        manager.create_prefix_cache("liar")


def test_non_string_name_to_create_is_a_type_error():
    with pytest.raises(TypeError, match="must be a str"):
        PluginManager(entry_points=False).create("prefix_cache", 7)


def test_prefix_cache_config_is_frozen_and_validated():
    config = kvplug.PrefixCacheConfig(device="cpu", page_size=4, options={"a": 1})
    assert config.device.type == "cpu" and config.options["a"] == 1
    with pytest.raises(Exception):
        config.page_size = 8  # type: ignore[misc]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="page_size"):
            kvplug.PrefixCacheConfig(page_size=bad)


# ---------------------------------------------------------------- entry points


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path into which tests write fake installed distributions."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def install(site, kind: str, entry_point: str, cache_name: str = "") -> str:
    module = f"fake_kvplug_plugin_{next(_unique)}"
    source = SOURCES[kind].replace("{cache_name}", cache_name)
    make_distribution(site, f"fake-{entry_point}", "1.2.3", entry_point, module, source)
    importlib.invalidate_caches()
    return module


def test_entry_points_load_and_broken_plugin_only_warns(site):
    install(site, "good", "goodone", cache_name="from-entry-point")
    install(site, "broken", "brokenone")
    with pytest.warns(PluginLoadWarning) as record:
        manager = isolated_manager()
    message = "\n".join(str(warning.message) for warning in record)
    assert "'brokenone'" in message and "fake-brokenone 1.2.3" in message and "broken on purpose" in message
    assert "from-entry-point" in manager.available("prefix_cache")
    info = {plugin.name: plugin for plugin in manager.plugins()}["goodone"]
    assert (info.distribution, info.version, info.builtin) == ("fake-goodone", "1.2.3", False)
    assert info.provides == {"prefix_cache": ["from-entry-point"]}
    assert [failure.entry_point for failure in manager.load_failures] == ["brokenone"]


def test_strict_mode_turns_a_broken_plugin_into_an_error(site):
    install(site, "broken", "brokentwo")
    with pytest.raises(kvplug.PluginLoadError, match="brokentwo.*fake-brokentwo 1.2.3"):
        isolated_manager(KVPLUG_STRICT_PLUGINS="1")


def test_misspelt_entry_point_warns_or_raises_pluggy_validation(site):
    install(site, "misspelt", "misspelt")
    with pytest.warns(PluginLoadWarning, match="misspelt.*PluginValidationError"):
        isolated_manager()
    with pytest.raises(pluggy.PluginValidationError, match="misspelt"):
        isolated_manager(KVPLUG_STRICT_PLUGINS="1")


def test_allow_list_and_block_list(site):
    install(site, "good", "alpha", cache_name="alpha-cache")
    install(site, "good", "beta", cache_name="beta-cache")
    names = lambda manager: set(manager.available("prefix_cache"))  # noqa: E731
    assert {"alpha-cache", "beta-cache"} <= names(isolated_manager())
    only_alpha = names(isolated_manager(KVPLUG_LOAD_PLUGINS="alpha"))
    assert "alpha-cache" in only_alpha and "beta-cache" not in only_alpha
    none = names(isolated_manager(KVPLUG_LOAD_PLUGINS=""))
    assert none == {"naive", "radix"}
    blocked = names(isolated_manager(KVPLUG_DISABLE_PLUGINS="beta, alpha"))
    assert "alpha-cache" not in blocked and "beta-cache" not in blocked
    # the block list wins over the allow list
    assert "alpha-cache" not in names(isolated_manager(KVPLUG_LOAD_PLUGINS="alpha", KVPLUG_DISABLE_PLUGINS="alpha"))


def test_entry_point_colliding_with_a_builtin_is_skipped_and_reported(site):
    install(site, "colliding", "shadow", cache_name="radix")
    install(site, "good", "zzz-after", cache_name="after-cache")
    with pytest.warns(PluginLoadWarning, match="'shadow'.*kvplug.builtin.prefix_caches.*'shadow'.*skipped"):
        manager = isolated_manager()
    assert manager.providers("prefix_cache") == {
        "naive": "kvplug.builtin.prefix_caches",
        "radix": "kvplug.builtin.prefix_caches",
        "after-cache": "zzz-after",
    }
    assert "radix-own" not in manager.available("prefix_cache")  # nothing of the skipped plugin stays
    assert [(failure.entry_point, type(failure.error)) for failure in manager.load_failures] == [
        ("shadow", kvplug.DuplicateComponentError)
    ]
    assert "shadow" not in {info.name for info in manager.plugins()}
    assert isinstance(manager.create_prefix_cache("naive"), NaivePrefixCache)
    strict_message = "shadow.*registered twice.*kvplug.builtin.prefix_caches"
    with pytest.raises(kvplug.PluginLoadError, match=strict_message) as caught:
        isolated_manager(KVPLUG_STRICT_PLUGINS="1")
    assert isinstance(caught.value.__cause__, kvplug.DuplicateComponentError)
    assert "radix" in isolated_manager(KVPLUG_DISABLE_PLUGINS="shadow").available("prefix_cache")


def test_entry_point_colliding_with_another_plugin_loses_to_the_first_loaded(site):
    install(site, "good", "aaa-first", cache_name="contested")
    install(site, "good", "bbb-second", cache_name="contested")
    with pytest.warns(PluginLoadWarning, match="'bbb-second'.*'aaa-first' and by plugin 'bbb-second'"):
        manager = isolated_manager()
    assert manager.providers("prefix_cache")["contested"] == "aaa-first"
    assert [failure.entry_point for failure in manager.load_failures] == ["bbb-second"]


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("raising-hook", r"PluginRegistrationError: plugin 'bad' raised RuntimeError: this hook is broken on purpose"),
        ("exit-on-import", r"called sys.exit\(3\) on import"),
        ("exit-in-hook", r"plugin 'bad' called sys.exit\('exiting from a hook on purpose'\)"),
        ("broken", r"RuntimeError: this plugin is broken on purpose"),
    ],
)
def test_failing_entry_point_is_skipped_reported_or_raised_when_strict(site, kind, reason):
    install(site, kind, "bad")
    install(site, "good", "fine", cache_name="fine-cache")
    with pytest.warns(PluginLoadWarning, match="'bad'.*fake-bad 1.2.3.*skipped"):
        manager = isolated_manager()
    assert [failure.entry_point for failure in manager.load_failures] == ["bad"]
    assert re.search(reason, manager.load_failures[0].reason)
    assert manager.available("prefix_cache") == ["fine-cache", "naive", "radix"]
    assert isinstance(manager.create_prefix_cache("naive"), NaivePrefixCache)
    with pytest.raises(kvplug.PluginLoadError, match="'bad'.*KVPLUG_STRICT_PLUGINS"):
        isolated_manager(KVPLUG_STRICT_PLUGINS="1")


def test_default_manager_survives_a_colliding_plugin(site):
    install(site, "colliding", "shadow-default", cache_name="radix")
    kvplug.reset_default_manager()
    try:
        with pytest.warns(PluginLoadWarning, match="shadow-default"):
            cache = kvplug.create_prefix_cache("naive")
        assert isinstance(cache, NaivePrefixCache)
        assert kvplug.available("prefix_cache") == ["naive", "radix"]
    finally:
        kvplug.reset_default_manager()


def test_why_not_loaded_tells_filtered_failed_and_missing_apart(site):
    install(site, "good", "picky", cache_name="picky-cache")
    install(site, "broken", "crashy")
    with pytest.warns(PluginLoadWarning):
        manager = isolated_manager(KVPLUG_LOAD_PLUGINS="crashy")
    assert manager.why_not_loaded("picky") == (
        "it is installed (fake-picky 1.2.3) but not loaded: KVPLUG_LOAD_PLUGINS='crashy' does not list it"
    )
    assert manager.why_not_loaded("crashy") == (
        "its plugin failed to load: RuntimeError: this plugin is broken on purpose"
    )
    assert manager.why_not_loaded("absent") == "it is not installed"
    empty = isolated_manager(KVPLUG_LOAD_PLUGINS="")
    assert "KVPLUG_LOAD_PLUGINS='' does not list it" in empty.why_not_loaded("picky")
    with pytest.warns(PluginLoadWarning):
        loaded = isolated_manager()
    assert loaded.why_not_loaded("picky") == "its plugin is loaded but registers nothing under that name"
    blocked = isolated_manager(KVPLUG_DISABLE_PLUGINS="picky,crashy")
    assert blocked.why_not_loaded("picky").endswith("not loaded: KVPLUG_DISABLE_PLUGINS lists it")


def test_create_refuses_cuda_without_cuda_and_a_missing_config():
    manager = PluginManager(entry_points=False)
    if not torch.cuda.is_available():
        with pytest.raises(kvplug.InvalidArgumentError, match="CUDA is not available"):
            manager.create_prefix_cache("radix", device="cuda")
    with pytest.raises(kvplug.InvalidArgumentError, match="KVPoolConfig, got None"):
        manager.create_kv_pool("mha", None)
    with pytest.raises(kvplug.InvalidArgumentError, match="AttentionConfig, got"):
        manager.create_attention_backend("torch", {"num_qo_heads": 2})
    with pytest.raises(kvplug.InvalidArgumentError, match="KVPoolConfig"):
        kvplug.create_kv_pool("mha", None)
