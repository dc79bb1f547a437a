"""Test-only import placeholder for ``sgl_kernel.quantization`` (see ../README.md)."""

from sgl_kernel._placeholder import module_getattr, placeholder

__getattr__ = module_getattr(__name__)

for _name in ("ggml_dequantize", "ggml_mul_mat_vec_a8", "ggml_mul_mat_a8", "ggml_moe_a8", "ggml_moe_a8_vec"):
    globals()[_name] = placeholder(__name__, _name)
del _name
