"""A real SGLang 0.5.23 server on the CPU with kvplug's host-memory tier (``--kvplug-host-memory``).

Two servers on the same tiny random Llama-shaped model, both ``--kv-backend kvplug`` with a KV pool
of 256 tokens, one with a host tier: ten distinct 100-token prompts (byte-level tokenizer) push
the earlier ones out of the pool, then the first three come back. Greedy outputs must be
token-identical; the tiered server must answer the returning prompts from the host tier (their
``cached_tokens`` cover the prompt, SGLang's prefill log counts them as cached) where the other
recomputes them, and SGLang's ``sglang:prefill_effective_tokens_total{mode="host_hit"}`` counts
them); the tier's startup line must be logged; SIGTERM must stop both cleanly.

Runs in the SGLang test environment (``scripts/test-sglang-host.sh``); about one and a half
minutes on the 2-core machine, most of it two server starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang_helpers import import_sglang

import_sglang()

from tests.sglang_models import build_model  # noqa: E402
from tests.sglang_server import Server  # noqa: E402

PROMPTS = [f"{number}: " + chr(ord("a") + number) * 97 for number in range(10)]  # 100 tokens each
RETURNING = [0, 1, 2]
MAX_NEW_TOKENS = 4
POOL_TOKENS = 256
FLAGS = (
    "--kv-backend", "kvplug", "--kvplug-attention", "torch",
    "--max-total-tokens", str(POOL_TOKENS), "--max-running-requests", "2", "--enable-metrics",
)  # fmt: skip
HOST_HIT_METRIC = 'sglang:prefill_effective_tokens_total{'  # SGLang's counter, label mode="host_hit"


def serve(model: Path, log: Path, *flags: str) -> tuple[Server, list[tuple[list[int], int]], float]:
    """Start a server, send every prompt then the returning ones, one at a time; returns the server,
    ``(output ids, cached_tokens)`` per request and SGLang's host-hit token counter."""
    import requests

    server = Server(model, log, *FLAGS, *flags).start()
    try:
        answers = []
        for prompt in PROMPTS + [PROMPTS[number] for number in RETURNING]:
            answer = server.generate(prompt, MAX_NEW_TOKENS)
            answers.append((answer["output_ids"], answer["meta_info"]["cached_tokens"]))
        metrics = requests.get(f"{server.url}/metrics", timeout=30).text
        host_hits = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith(HOST_HIT_METRIC) and 'mode="host_hit"' in line
        )
        return server, answers, host_hits
    except BaseException:
        server.kill()
        raise


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-host-tier")
    model = build_model("llama", root / "llama")
    plain, plain_answers, plain_hits = serve(model, root / "plain.log")
    plain_status = plain.stop()
    tiered, tiered_answers, tiered_hits = serve(model, root / "tiered.log", "--kvplug-host-memory", "16MiB")
    tiered_status = tiered.stop()
    return dict(
        plain=(plain, plain_answers, plain_status, plain_hits), tiered=(tiered, tiered_answers, tiered_status, tiered_hits)
    )


def test_greedy_outputs_are_identical_with_and_without_the_tier(runs):
    plain, tiered = runs["plain"][1], runs["tiered"][1]
    assert len(plain) == len(tiered) == len(PROMPTS) + len(RETURNING)
    for number, ((got, _), (expected, _)) in enumerate(zip(tiered, plain)):
        assert got == expected, f"request {number}: with the tier {got} != without {expected}"
    assert all(len(ids) == MAX_NEW_TOKENS for ids, _ in tiered)


def test_returning_prompts_are_served_from_the_host_tier(runs):
    returning = slice(len(PROMPTS), None)
    plain_cached = [cached for _, cached in runs["plain"][1][returning]]
    tiered_cached = [cached for _, cached in runs["tiered"][1][returning]]
    # without the tier the pool (256 tokens) lost them: at most the 3-token "N: " head is shared
    assert max(plain_cached) < 10, plain_cached
    # with it the whole prompt but its last token (SGLang always computes one) came back from host memory
    assert tiered_cached == [len(PROMPTS[number]) - 1 for number in RETURNING], tiered_cached
    log = runs["tiered"][0].log.read_text(errors="replace")
    assert "kvplug-sglang: host-memory tier of 16,777,216 bytes" in log, runs["tiered"][0].log_tail()
    assert "#cached-token: 99" in log  # SGLang's own prefill log line counts the host hit as cached
    # SGLang's metric splits cached tokens by tier: the returning prompts' hits came from the host
    assert (runs["plain"][3], runs["tiered"][3]) == (0, sum(tiered_cached))


def test_both_servers_stop_cleanly(runs):
    for name in ("plain", "tiered"):
        server, _, status, _ = runs[name]
        assert status == 0, f"{name}: exit status {status}"
        assert "Traceback" not in server.log.read_text(errors="replace"), server.log_tail()


@pytest.mark.parametrize(("host_memory", "message"), [
    ("1", "host_memory=1 bytes holds no KV page of"),
    ("1000TiB", "the host-memory tier needs 1,099,511,627,776,000 bytes"),
])
def test_a_bad_tier_size_stops_the_server_before_it_is_healthy(tmp_path, host_memory, message):
    """Issue 32: a tier below one page, or past free host memory, is a start-up error naming both
    sizes; the server never answers ``/health`` (it used to start and fail at the first eviction)."""
    import requests

    model = build_model("llama", tmp_path / "llama")
    server = Server(model, tmp_path / "bad.log", *FLAGS, "--kvplug-host-memory", host_memory)
    try:
        with pytest.raises(AssertionError, match="exited with .* at startup"):
            server.start()
        healthy = False  # start() polled /health until the exit; one more look
        try:
            healthy = requests.get(f"{server.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            pass
        assert not healthy and server.process.returncode != 0
        log = server.log.read_text(errors="replace")
        assert message in log, server.log_tail()
        assert ("of host memory are available" in log) if "TiB" in host_memory else ("bytes (all layers" in log)
    finally:
        server.kill()
