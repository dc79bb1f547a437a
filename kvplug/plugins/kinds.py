"""The kinds of component plugins provide, each tied to its registration hook and base class."""

from __future__ import annotations

from dataclasses import dataclass

from kvplug.interface import BaseAttentionBackend, BaseKVPool, BasePrefixCache


@dataclass(frozen=True)
class ComponentKind:
    """One kind of component.

    Attributes:
        name: the kind as users spell it (``kvplug.available(name)``).
        hook: the hook through which plugins register it.
        base: the class every factory's result must be an instance of (``None``: any object).
    """

    name: str
    hook: str
    base: type | None


COMPONENT_KINDS: dict[str, ComponentKind] = {
    kind.name: kind
    for kind in (
        ComponentKind("prefix_cache", "kvplug_register_prefix_caches", BasePrefixCache),
        ComponentKind("kv_pool", "kvplug_register_kv_pools", BaseKVPool),
        ComponentKind("attention", "kvplug_register_attention_backends", BaseAttentionBackend),
        ComponentKind("host", "kvplug_register_hosts", None),
    )
}


def get_kind(kind: str) -> ComponentKind:
    """Look a kind up by name; a bad kind is a ``ValueError`` listing the valid ones."""
    try:
        return COMPONENT_KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown component kind {kind!r}; expected one of {sorted(COMPONENT_KINDS)}") from None
