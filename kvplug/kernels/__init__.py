"""kvplug's own GPU kernels. Each module imports Triton itself, so import them only where
Triton is available (``pip install triton``, or ``pip install -e ".[triton]"`` in the repository): ``kvplug.kernels.store_kv``."""
