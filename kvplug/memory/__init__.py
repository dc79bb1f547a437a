"""KV memory: the ``mha`` pool, the page table + token pool, request rows, the paged allocator,
and capacity planning. Hosts normally reach these through ``kvplug.create_backend``.

The names below are imported on first use (a module ``__getattr__``), so importing one torch-free
module of this package (``capacity``, ``model_config``) does not import torch.
"""

from __future__ import annotations

from kvplug.lazy_names import lazy_attributes

_LAZY_NAMES = {
    "CapacityPlan": "kvplug.memory.capacity",
    "parse_memory_size": "kvplug.memory.capacity",
    "plan_capacity": "kvplug.memory.capacity",
    "MHAKVPool": "kvplug.memory.mha_pool",
    "ModelShape": "kvplug.memory.model_shape",
    "PageTable": "kvplug.memory.page_table",
    "PagedAllocator": "kvplug.memory.allocator",
    "Request": "kvplug.memory.request",
    "RequestTable": "kvplug.memory.request",
}

__all__ = list(sorted(_LAZY_NAMES))


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY_NAMES)
