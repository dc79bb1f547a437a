"""Test-only import placeholder for ``IPython.display`` (``sglang.utils`` imports it for notebooks)."""

from typing import Any


def display(*args: Any, **kwargs: Any) -> None:
    raise NotImplementedError("IPython.display is a test-only import placeholder (tests/sglang_gpu_support)")


class HTML:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("IPython.display is a test-only import placeholder (tests/sglang_gpu_support)")


class Markdown(HTML):
    pass
