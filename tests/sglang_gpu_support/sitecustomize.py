"""Test-only: import-only ``torchvision`` modules for SGLang's config package (see README.md).

Runs at interpreter start when this folder is on ``PYTHONPATH`` (scripts/device-sglang-graphs.sh
only). transformers first records torchvision as absent (so it never takes a torchvision path),
then ``torchvision``, ``torchvision.transforms`` and ``torchvision.transforms.functional`` are put
in ``sys.modules``: ``InterpolationMode`` (which SGLang reads at import) is real, any other
attribute raises ``AttributeError``. Nothing happens where torchvision is installed.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types


def _install_torchvision_placeholder() -> None:
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    try:
        from transformers.utils import import_utils
    except ImportError:
        pass
    else:
        import_utils.is_torchvision_available()  # cached: False

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    def refuse(module: str):
        def getattr_(name: str):
            raise AttributeError(f"{module}.{name}: torchvision is a test-only import placeholder here")

        return getattr_

    modules = []
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        module = types.ModuleType(name, "test-only import placeholder (tests/sglang_gpu_support)")
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        module.__getattr__ = refuse(name)
        sys.modules[name] = module
        modules.append(module)
    torchvision, transforms, functional = modules
    transforms.InterpolationMode = functional.InterpolationMode = InterpolationMode
    torchvision.transforms, transforms.functional = transforms, functional


_install_torchvision_placeholder()
