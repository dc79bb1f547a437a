"""kvplug's Triton kernels on the CPU, through Triton's interpreter (``tests/kernels_interpreted``),
against their torch reference paths. Needs Triton installed (the README's test set-up installs
it); the interpreter flag has to be set before Triton is imported, hence a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.attention_reference import importable

pytestmark = pytest.mark.skipif(
    not importable("triton"), reason="needs triton (the README's test set-up installs triton==3.6.0 for its interpreter)"
)


def test_kernels_match_their_torch_paths_in_the_triton_interpreter():
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVPLUG_TRITON_FAST_LAUNCH": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels_interpreted"], cwd=root, env=env, capture_output=True, text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "all checks passed" in done.stdout
