"""What every placeholder name is: a callable that refuses to run (see ../README.md)."""

from __future__ import annotations

from typing import Any, Callable


def placeholder(module: str, name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{module}.{name} is a test-only import placeholder (tests/sglang_gpu_support): sgl-kernel is not "
            "installed on this machine"
        )

    refuse.__name__ = refuse.__qualname__ = name
    return refuse


def module_getattr(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` answering any other public name with a placeholder."""

    def getattr_(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return placeholder(module, name)

    return getattr_
