"""KV memory: the ``mha`` pool, the page table + token pool, request rows, the paged allocator,
and capacity planning. Hosts normally reach these through ``kvplug.create_backend``."""

from kvplug.memory.allocator import PagedAllocator
from kvplug.memory.capacity import CapacityPlan, parse_memory_size, plan_capacity
from kvplug.memory.mha_pool import MHAKVPool
from kvplug.memory.model_shape import ModelShape
from kvplug.memory.page_table import PageTable
from kvplug.memory.request import Request
from kvplug.memory.row_manager import RowManager

__all__ = [
    "CapacityPlan",
    "MHAKVPool",
    "ModelShape",
    "PageTable",
    "PagedAllocator",
    "Request",
    "RowManager",
    "parse_memory_size",
    "plan_capacity",
]
