"""kvplug's Triton attention kernels (``decode``: split-K paged decode; ``extend``: paged
prefill/extend). Each module imports Triton, so import them only where it is installed."""
