"""The vLLM adapter README's Python snippets run as written on vLLM's CPU build (issue 29: every
README snippet runs in CI), extracted from the Markdown by ``tests/test_docs_and_examples.py``'s
``python_snippets``; ``MODEL`` (the snippet reads it from the environment) is a tiny checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_docs_and_examples import REPO, VLLM_DOCUMENTS, python_snippets

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test-vllm-host.sh builds its CPU build)")
pytest.importorskip("kvplug_vllm", reason="kvplug-vllm is not installed (pip install -e adapters/vllm)")

from tests.vllm_models import build_model  # noqa: E402

SNIPPETS = [snippet for document in VLLM_DOCUMENTS for snippet in python_snippets(document)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("vllm-model") / "tiny-llama")


@pytest.mark.parametrize(
    "snippet",
    [pytest.param(s, id=f"{s.document}:{s.line}",
                  marks=[pytest.mark.skip(reason=s.skip_reason)] if s.skip_reason else []) for s in SNIPPETS],
)
def test_vllm_readme_snippet_runs(snippet, model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    # this checkout's kvplug and kvplug-vllm, whatever the environment has installed
    path = [str(REPO), str(REPO / "adapters" / "vllm"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, MODEL=str(model_dir), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join(filter(None, path)))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=540)
    assert result.returncode == 0, f"{snippet.document}:{snippet.line}\n{snippet.code}\n{result.stderr[-6000:]}"
    # the second prompt shares the first's long prefix: kvplug's radix cache served part of it
    cached = [int(line.split()[0]) for line in result.stdout.splitlines() if "cached prompt tokens" in line]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0, result.stdout[-2000:]
