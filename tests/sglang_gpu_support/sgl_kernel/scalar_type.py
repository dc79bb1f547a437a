"""Test-only import placeholder for ``sgl_kernel.scalar_type`` (see ../README.md)."""

from types import SimpleNamespace

from sgl_kernel._placeholder import module_getattr


class ScalarType:
    """Placeholder: SGLang's quantization utilities name it in annotations and tables only."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"ScalarType({self.name!r}, placeholder)"


scalar_types = SimpleNamespace(**{name: ScalarType(name) for name in ("uint4", "uint4b8", "uint8", "uint8b128")})

__getattr__ = module_getattr(__name__)
