"""kvplug's own GPU kernels. Each module imports Triton itself, so import them only where
Triton is available (``pip install kvplug[triton]``): ``kvplug.kernels.store_kv``."""
