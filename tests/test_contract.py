"""SPEC §3: the names third-party plugins and external tests rely on."""

from __future__ import annotations

import dataclasses

import pluggy
import torch

import kvplug
from kvplug import hookspecs
from kvplug.plugins import ENTRY_POINT_GROUP

TOP_LEVEL = [
    "BasePrefixCache", "MatchResult", "InsertResult", "SizeInfo", "PrefixCacheConfig",
    "UnknownComponentError", "hookimpl", "available", "create_prefix_cache", "INTERFACE_VERSION",
]


def test_top_level_names():
    for name in TOP_LEVEL:
        assert hasattr(kvplug, name), name
    assert kvplug.INTERFACE_VERSION == 1
    assert isinstance(kvplug.__version__, str)
    assert issubclass(kvplug.UnknownComponentError, KeyError)


def test_pluggy_project_and_entry_point_group():
    assert ENTRY_POINT_GROUP == "kvplug" and hookspecs.PROJECT_NAME == "kvplug"
    assert isinstance(kvplug.hookimpl, pluggy.HookimplMarker) and kvplug.hookimpl.project_name == "kvplug"
    specs = {name for name in dir(hookspecs) if name.startswith("kvplug_register_")}
    assert specs == {
        "kvplug_register_prefix_caches", "kvplug_register_kv_pools",
        "kvplug_register_attention_backends", "kvplug_register_hosts",
        "kvplug_register_kv_stores",  # issue 30, additive to version 1
    }


def test_prefix_cache_abstract_surface_is_the_seven_members():
    assert kvplug.BasePrefixCache.__abstractmethods__ == {
        "match_prefix", "lock_handle", "insert_prefix", "evict", "reset", "size_info", "check_integrity",
    }


def test_result_types():
    info = kvplug.SizeInfo(evictable_size=3, protected_size=4)
    assert info.total_size == 7 and isinstance(info, tuple)
    assert kvplug.InsertResult._fields == ("cached_len", "handle")
    assert kvplug.MatchResult._fields == ("handle",)
    handle = kvplug.create_prefix_cache("naive").match_prefix(torch.tensor([1, 2], dtype=torch.int32)).handle
    assert handle.cached_len == 0 and handle.get_matched_indices().dtype == torch.int32
    assert kvplug.MatchResult(handle).cuda_handle is handle  # mini-sglang's field name


def test_prefix_cache_config_fields():
    fields = {field.name for field in dataclasses.fields(kvplug.PrefixCacheConfig)}
    assert {"device", "page_size"} <= fields
    assert kvplug.PrefixCacheConfig.__dataclass_params__.frozen


def test_available_kinds():
    for kind in ("prefix_cache", "kv_pool", "attention", "host"):
        assert isinstance(kvplug.available(kind), list)
    assert {"naive", "radix"} <= set(kvplug.available("prefix_cache"))


def test_create_prefix_cache_passes_options_through_config():
    class Recorder(kvplug.BasePrefixCache):
        def __init__(self, config):
            self.config = config

        match_prefix = lock_handle = insert_prefix = evict = reset = check_integrity = lambda *a, **k: None  # noqa: E731
        size_info = property(lambda self: kvplug.SizeInfo(0, 0))

    class Plugin:
        @kvplug.hookimpl
        def kvplug_register_prefix_caches(self, register):
            register("recorder", Recorder)

    manager = kvplug.PluginManager(entry_points=False)
    manager.register(Plugin(), "recorder-plugin")
    cache = kvplug.create_prefix_cache("recorder", page_size=16, manager=manager, capacity=9)
    assert cache.config.page_size == 16 and cache.config.options == {"capacity": 9}
    assert cache.config.device == torch.device("cpu")
