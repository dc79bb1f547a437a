"""Every script in ``examples/`` and every Python snippet of the READMEs runs, as a user would run it.

Snippets are extracted from the Markdown at test time (never copied here). A snippet that cannot
run on a CPU-only machine says so in the Markdown, on the line right before its fence:
``<!-- snippet: skip: REASON -->``; it is then reported as skipped with that reason. A fence
without the marker runs, so a new snippet cannot be left out silently.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.serve_process import free_port, kvplug_env

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", "adapters/transformers/README.md", "adapters/sglang/README.md",
             "examples/third_party_plugin/README.md", "docs/design.md", "docs/remote-kv.md"]
# snippets that need vLLM run with vLLM's interpreter: tests/test_vllm_readme.py
VLLM_DOCUMENTS = ["adapters/vllm/README.md"]
EXAMPLES = sorted(path.name for path in (REPO / "examples").glob("*.py"))
SKIP_MARKER = re.compile(r"^<!--\s*snippet:\s*skip:\s*(?P<reason>\S.*?)\s*-->$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")


class Snippet(NamedTuple):
    document: str
    line: int  # 1-based line of the opening fence
    code: str
    skip_reason: str | None


def python_snippets(document: str) -> list[Snippet]:
    """The ```python blocks of ``document``, each with the skip reason of a marker right before it."""
    lines = (REPO / document).read_text().splitlines()
    snippets, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        if opening["lang"] == "python":
            marker = SKIP_MARKER.match(lines[index - 1].strip()) if index else None
            snippets.append(Snippet(document, index + 1, "\n".join(lines[index + 1 : end]) + "\n",
                                    marker["reason"] if marker else None))
        index = end + 1
    return snippets


SNIPPETS = [snippet for document in DOCUMENTS for snippet in python_snippets(document)]


def run_python(argv: list[str], cwd: Path, cache_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = kvplug_env(cache_dir)
    env["PYTHONPATH"] = f"{REPO / 'adapters' / 'transformers'}:{env['PYTHONPATH']}"
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvplug-cache")


def test_the_markdown_has_the_snippets_this_test_expects():
    # the extraction itself must be able to fail: the READMEs hold python fences, and a marker
    # without a reason (or one not right before a fence) does not count as a skip
    assert len(SNIPPETS) >= 5, SNIPPETS
    assert any(s.skip_reason is None for s in SNIPPETS) and any(s.skip_reason for s in SNIPPETS)
    for document in DOCUMENTS + VLLM_DOCUMENTS:
        text = (REPO / document).read_text()
        markers = text.count("<!-- snippet: skip")
        snippets = python_snippets(document)
        assert markers == sum(1 for s in snippets if s.skip_reason), document
    # every Markdown file with a python fence is run here or in tests/test_vllm_readme.py
    fenced = {str(path.relative_to(REPO)) for path in REPO.glob("**/*.md")
              if ".venv" not in path.parts and "```python" in path.read_text()}
    assert fenced <= set(DOCUMENTS + VLLM_DOCUMENTS), sorted(fenced - set(DOCUMENTS + VLLM_DOCUMENTS))
    assert python_snippets("adapters/vllm/README.md")


@pytest.mark.parametrize(
    "snippet",
    [pytest.param(s, id=f"{s.document}:{s.line}",
                  marks=[pytest.mark.skip(reason=s.skip_reason)] if s.skip_reason else [])
     for s in SNIPPETS],
)
def test_readme_snippet_runs(snippet: Snippet, tmp_path, cache_dir):
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    result = run_python([str(script)], tmp_path, cache_dir)
    assert result.returncode == 0, f"{snippet.document}:{snippet.line}\n{snippet.code}\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_script_runs(example: str, tmp_path, cache_dir):
    argv = [str(REPO / "examples" / example)]
    if example == "serve_and_chat.py":
        pytest.importorskip("openai")
        argv += ["--port", str(free_port())]
    result = run_python(argv, tmp_path, cache_dir)
    assert result.returncode == 0, f"{example}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-4000:]


def test_package_stats_is_callable_after_install(cache_dir):
    """``kvplug_transformers.stats()`` after ``install()``: no submodule may shadow the function."""
    code = (
        "import kvplug_transformers\n"
        "kvplug_transformers.install(page_size=16)\n"
        "assert callable(kvplug_transformers.stats), kvplug_transformers.stats\n"
        "stats = kvplug_transformers.stats()\n"
        "assert isinstance(stats, kvplug_transformers.HostStats), type(stats)\n"
        "print(stats.describe())\n"
        "kvplug_transformers.uninstall()\n"
    )
    result = run_python(["-c", code], REPO, cache_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "kvplug cache:" in result.stdout
