"""The kinds of component plugins provide, each tied to its registration hook and base class."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ComponentKind:
    """One kind of component.

    Attributes:
        name: the kind as users spell it (``kvplug.available(name)``).
        hook: the hook through which plugins register it.
        base_path: ``"module:Class"`` of the class every factory's result must be an instance of
            (``None``: any object). A path, not the class, so that listing and loading plugins
            does not import the interface's tensor types.
    """

    name: str
    hook: str
    base_path: str | None

    @property
    def base(self) -> type | None:
        if self.base_path is None:
            return None
        module, _, qualname = self.base_path.partition(":")
        return getattr(importlib.import_module(module), qualname)


COMPONENT_KINDS: dict[str, ComponentKind] = {
    kind.name: kind
    for kind in (
        ComponentKind("prefix_cache", "kvplug_register_prefix_caches", "kvplug.interface:BasePrefixCache"),
        ComponentKind("kv_pool", "kvplug_register_kv_pools", "kvplug.interface:BaseKVPool"),
        ComponentKind("attention", "kvplug_register_attention_backends", "kvplug.interface:BaseAttentionBackend"),
        ComponentKind("host", "kvplug_register_hosts", None),
        ComponentKind("kv_store", "kvplug_register_kv_stores", "kvplug.interface:BaseKVStore"),  # issue 30
    )
}


def get_kind(kind: str) -> ComponentKind:
    """Look a kind up by name; a bad kind is a ``ValueError`` listing the valid ones."""
    try:
        return COMPONENT_KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown component kind {kind!r}; expected one of {sorted(COMPONENT_KINDS)}") from None
