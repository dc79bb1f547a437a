"""Test-only import placeholder for ``sgl_kernel`` (see ../README.md): nothing here runs."""

from sgl_kernel._placeholder import module_getattr, placeholder

__getattr__ = module_getattr(__name__)

for _name in (
    "int8_scaled_mm", "moe_sum", "moe_sum_reduce", "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul",
    "rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm",
):
    globals()[_name] = placeholder(__name__, _name)
del _name
