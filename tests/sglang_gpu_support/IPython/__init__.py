"""Test-only import placeholder for IPython (see ../README.md)."""
