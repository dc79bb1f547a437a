"""benchmarks/vllm_prefix.py's pure parts: its prompts, the hit-rate / ratio arithmetic and the table.

The engines themselves need vLLM's CPU build (the script is run there, not timed here).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("vllm_prefix", Path(__file__).resolve().parents[1] / "benchmarks"
                                               / "vllm_prefix.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def result(cached, prompt, ttft, out_tokens, seconds, tokens):
    return {"cached": cached, "prompt_tokens": prompt, "ttft_s": ttft, "output_tokens": out_tokens,
            "seconds": seconds, "tokens": tokens}


def test_shared_prompts_share_the_system_prompt_and_differ_after_it():
    first, rest = bench.prompts("shared", 5)
    assert len(first) == 1 and len(rest) == 4
    everyone = first + rest
    assert all(p[:8 * bench.BLOCK] == everyone[0][:8 * bench.BLOCK] for p in everyone)
    assert len({tuple(p[8 * bench.BLOCK:]) for p in everyone}) == 5
    assert bench.prompts("shared", 5) == [first, rest]  # seeded: the same for every variant


def test_working_set_second_turns_extend_the_first_and_exceed_the_pool():
    turn1, turn2 = bench.prompts("working-set", 16)
    assert all(b[:len(a)] == a and len(b) > len(a) for a, b in zip(turn1, turn2))
    assert sum(len(p) for p in turn2) // bench.BLOCK > 40  # the pool the worker gives this workload
    with pytest.raises(ValueError, match="workload must be one of"):
        bench.prompts("other", 1)


def test_summarize_computes_hit_rate_and_ratios_to_native():
    native = result([0, 0], [100, 300], [0.2, 0.4, 0.6], 32, 4.0, [[1], [2]])
    radix = result([50, 150], [100, 300], [0.1, 0.2, 0.3], 32, 2.0, [[1], [2]])
    host = result([0, 100], [100, 300], [0.4, 0.4, 0.4], 32, 8.0, [[1], [3]])
    rows = bench.summarize({"shared": {"native": native, "radix": radix, "radix+host": host}})
    by = {r.variant: r for r in rows}
    assert by["native"].hit_rate == 0 and by["native"].ttft_ratio == 1 and by["native"].tok_s_ratio == 1
    assert by["radix"].hit_rate == pytest.approx(0.5) and by["radix"].ttft_p50_ms == pytest.approx(200)
    assert by["radix"].ttft_ratio == pytest.approx(2.0) and by["radix"].tok_s_ratio == pytest.approx(2.0)
    assert by["radix+host"].hit_rate == pytest.approx(0.25) and by["radix+host"].tok_s_ratio == pytest.approx(0.5)
    assert by["radix+host"].ttft_mean_ms == pytest.approx(400) and by["radix+host"].identical is False
    assert by["radix"].identical is True and by["radix"].out_tok_s == pytest.approx(16)
    text = bench.table(rows)
    assert text.splitlines()[1].count("---") == 11
    assert "| shared | radix | 50.0% | 200.0 | 200.0 | 16.0 | 2.00 | 2.00 | 200.0 (2.00) | 16.0 (2.00) | yes |" in text
    assert text.rstrip().endswith("| 4.0 (0.50) | NO |")


def test_pool_concatenates_repeats_and_keeps_each_repeats_figures():
    a = result([0], [100], [0.1], 16, 1.0, [[1]])
    b = result([50], [100], [0.3], 16, 4.0, [[1]])
    merged = bench.pool([a, b])
    assert merged["cached"] == [0, 50] and merged["ttft_s"] == [0.1, 0.3] and merged["tokens"] == [[1], [1]]
    assert merged["output_tokens"] == 32 and merged["seconds"] == 5.0
    assert merged["repeats"] == [{"ttft_p50_ms": pytest.approx(100), "out_tok_s": 16.0},
                                 {"ttft_p50_ms": pytest.approx(300), "out_tok_s": 4.0}]


def test_best_ratios_use_each_variants_least_loaded_repeat():
    native = bench.pool([result([0], [100], [0.4], 16, 4.0, [[1]]), result([0], [100], [0.1], 16, 1.0, [[1]])])
    radix = bench.pool([result([50], [100], [0.05], 16, 0.5, [[1]]), result([50], [100], [0.9], 16, 8.0, [[1]])])
    by = {r.variant: r for r in bench.summarize({"w": {"native": native, "radix": radix}})}
    assert by["native"].best_ttft_p50_ms == pytest.approx(100) and by["native"].best_out_tok_s == pytest.approx(16)
    assert by["radix"].best_ttft_ratio == pytest.approx(2.0) and by["radix"].best_tok_s_ratio == pytest.approx(2.0)
    assert by["radix"].ttft_p50_ms == pytest.approx(475)  # pooled: the median of both runs' requests
