"""Shared pytest options: ``--run-slow`` enables long randomised runs; GPU tests skip without CUDA."""

from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = pytest.mark.skip(reason="slow: long randomised run; enable with --run-slow")
    skip_gpu = pytest.mark.skip(reason="gpu: needs a CUDA device (run on the GPU machine)")
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
