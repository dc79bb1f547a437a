"""The plugin contract: registration, validation, errors, entry-point loading and its variables."""

from __future__ import annotations

import importlib
import itertools

import pluggy
import pytest

import kvplug
from kvplug.plugins import PluginLoadWarning, PluginManager
from kvplug.prefix_cache.naive import NaivePrefixCache
from tests.plugin_fixtures import BROKEN_PLUGIN, GOOD_PLUGIN, MISSPELT_PLUGIN, make_distribution

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


def test_duplicate_name_names_both_plugins():
    manager = PluginManager(entry_points=False)
    manager.register(CachePlugin("naive"), "impostor")
    with pytest.raises(kvplug.DuplicateComponentError, match="kvplug.builtin.prefix_caches.*impostor"):
        manager.available("prefix_cache")


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
    manager.register(CachePlugin(name, factory), "sloppy-plugin")
    with pytest.raises(kvplug.PluginRegistrationError, match=message) as caught:
        manager.available("prefix_cache")
    assert "sloppy-plugin" in str(caught.value)


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
    source = {"good": GOOD_PLUGIN.format(cache_name=cache_name), "broken": BROKEN_PLUGIN, "misspelt": MISSPELT_PLUGIN}[kind]
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


def test_duplicate_name_from_entry_point_names_both(site):
    install(site, "good", "shadow", cache_name="radix")
    with pytest.raises(kvplug.DuplicateComponentError, match="kvplug.builtin.prefix_caches.*shadow"):
        isolated_manager().available("prefix_cache")
    assert "radix" in isolated_manager(KVPLUG_DISABLE_PLUGINS="shadow").available("prefix_cache")
