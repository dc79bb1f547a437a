"""``kvplug capacity`` and what it is built on: memory sizes, ModelShape from HF configs, plans."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvplug.cli import main
from kvplug.interface import InvalidArgumentError
from kvplug.memory.capacity import num_pages_for_budget, parse_memory_size, plan_capacity
from kvplug.memory.model_shape import ModelShape

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def qwen3_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B))
    return tmp_path


# ---------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "text,expected",
    [
        ("40GiB", 40 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1000000", 1_000_000),
        (" 2 kib ", 2048),
        ("3T", 3 * 10**12),
        (4096, 4096),
    ],
)
def test_parse_memory_size(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "40 GiBs", "0", "1e", True, None, "1.2.3MB"])
def test_bad_memory_sizes_raise(text):
    with pytest.raises(InvalidArgumentError):
        parse_memory_size(text)


# ---------------------------------------------------------------------- model shapes


def test_qwen3_shape_and_bytes_per_token(qwen3_dir):
    shape = ModelShape.from_pretrained(qwen3_dir)
    assert shape == ModelShape(28, 16, 8, 128, torch.bfloat16)
    assert shape.kv_bytes_per_token() == 114_688
    assert shape.kv_bytes_per_token(tp_size=2) == 57_344
    assert shape.kv_bytes_per_token(tp_size=16) == 114_688 // 8  # replicated: one head per rank
    assert ModelShape.from_pretrained(qwen3_dir / "config.json", dtype="fp32").kv_bytes_per_token() == 229_376


def test_missing_head_dim_and_kv_heads_are_derived():
    shape = ModelShape.from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 12, "hidden_size": 768})
    assert (shape.num_kv_heads, shape.head_dim, shape.dtype) == (12, 64, torch.bfloat16)
    nulls = ModelShape.from_hf_config(
        {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": None, "head_dim": None,
         "hidden_size": 512, "torch_dtype": "float16"}
    )
    assert (nulls.num_kv_heads, nulls.head_dim, nulls.dtype) == (8, 64, torch.float16)


def test_nested_text_config_and_attribute_objects():
    class Config:
        def to_dict(self):
            return {"text_config": dict(QWEN3_0_6B), "torch_dtype": "float32"}

    shape = ModelShape.from_hf_config(Config())
    assert (shape.num_layers, shape.num_kv_heads, shape.dtype) == (28, 8, torch.bfloat16)


@pytest.mark.parametrize(
    "config,match",
    [
        ({"num_attention_heads": 8, "hidden_size": 64}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "num_attention_heads": 6, "hidden_size": 64}, "not a multiple"),
        ({"num_hidden_layers": 2, "num_attention_heads": 8}, "hidden_size"),
        ({"num_hidden_layers": 0, "num_attention_heads": 8, "head_dim": 8}, "positive int"),
        ({"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 3, "head_dim": 8}, "multiple"),
        ({"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 8, "torch_dtype": "int8"}, "dtype"),
    ],
)
def test_bad_configs_name_the_problem(config, match):
    with pytest.raises(InvalidArgumentError, match=match):
        ModelShape.from_hf_config(config)


# ---------------------------------------------------------------------- plans


def test_plan_for_qwen3_in_40_gib(qwen3_dir):
    shape = ModelShape.from_pretrained(qwen3_dir)
    plan = plan_capacity(shape, "40GiB", context_len=4096)
    assert plan.bytes_per_token == 114_688
    assert plan.num_pages == 40 * 2**30 // 114_688 - 1 == 374_490  # minus the dummy page
    assert plan.num_tokens == 374_490 and plan.concurrent_requests == 374_490 // 4096
    assert plan.pool_bytes <= plan.memory_budget


def test_plan_with_pages_and_tensor_parallelism():
    shape = ModelShape(32, 32, 8, 128, torch.bfloat16)
    plan = plan_capacity(shape, 2**30, page_size=16, tp_size=2, context_len=1000)
    per_token = 2 * 32 * 4 * 128 * 2
    assert plan.bytes_per_token == per_token
    assert plan.num_pages == 2**30 // (per_token * 16) - 1
    assert plan.num_tokens == plan.num_pages * 16
    assert plan.concurrent_requests == plan.num_pages // 63  # ceil(1000 / 16) pages per request


def test_budget_too_small_for_two_pages():
    with pytest.raises(InvalidArgumentError, match="cannot hold 2 pages"):
        num_pages_for_budget(1000, 16, 31_999)
    assert num_pages_for_budget(1000, 16, 32_000) == 1


# ---------------------------------------------------------------------- CLI


def test_cli_text_output(qwen3_dir, capsys):
    assert main(["capacity", str(qwen3_dir), "--memory", "40GiB", "--context-len", "4096", "--page-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token: 114,688" in out
    assert "pages that fit: 374,490 of 1 token(s)" in out and "tokens that fit: 374,490" in out
    assert "concurrent requests at 4,096 tokens: 91" in out


def test_cli_page_size_defaults_to_serve_s(qwen3_dir, capsys):
    from kvplug.cli import build_parser
    from kvplug.cli.serve import DEFAULTS

    capacity_default = build_parser(["capacity"]).parse_args(["capacity", "--memory", "1GiB"]).page_size
    # serve resolves its defaults after parsing (to tell given flags apart): DEFAULTS is what it uses
    assert capacity_default == DEFAULTS["page_size"] == 16
    assert main(["capacity", str(qwen3_dir), "--memory", "40GiB", "--context-len", "4096"]) == 0
    out = capsys.readouterr().out
    # 40 GiB / (114,688 B x 16 tokens) = 23,405 pages, one of which is the dummy page
    assert "pages that fit: 23,404 of 16 token(s)" in out and "tokens that fit: 374,464" in out
    assert "concurrent requests at 4,096 tokens: 91" in out


def test_cli_flags_without_config_and_json(capsys):
    argv = ["capacity", "--layers", "28", "--kv-heads", "8", "--head-dim", "128", "--memory", "512MiB",
            "--page-size", "16", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bytes_per_token"] == 114_688 and data["page_size"] == 16
    assert data["num_pages"] == 512 * 2**20 // (114_688 * 16) - 1
    assert data["model"]["dtype"] == "bfloat16" and data["concurrent_requests"] is None


def test_cli_flags_override_the_config(qwen3_dir, capsys):
    assert main(["capacity", str(qwen3_dir), "--layers", "14", "--dtype", "fp32", "--memory", "1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 2 * 14 * 8 * 128 * 4


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--layers", "28", "--kv-heads", "8", "--memory", "1GiB"], "missing: --head-dim"),
        (["/no/such/model", "--memory", "1GiB"], "cannot read model config"),
        (["{qwen}", "--memory", "lots"], "memory size"),
        (["{qwen}", "--memory", "1GiB", "--tp-size", "3"], "cannot share 8 KV heads"),
        (["{qwen}", "--memory", "1KiB"], "cannot hold 2 pages"),
        (["{qwen}", "--memory", "1GiB", "--dtype", "int4"], "unknown KV dtype"),
        (["{qwen}", "--memory", "1GiB", "--page-size", "0"], "page_size"),
    ],
)
def test_cli_bad_input_is_a_clear_error(qwen3_dir, capsys, argv, message):
    argv = [arg.replace("{qwen}", str(qwen3_dir)) for arg in argv]
    assert main(["capacity", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_bad_json_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert main(["capacity", str(tmp_path), "--memory", "1GiB"]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_python_m_kvplug_capacity_exits_non_zero_without_traceback(qwen3_dir):
    result = subprocess.run(
        [sys.executable, "-m", "kvplug", "capacity", str(qwen3_dir), "--memory", "1GiB", "--tp-size", "5"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr and "tp_size=5" in result.stderr


@pytest.mark.parametrize("memory", ["0.9", ".5", "90%"])
def test_a_fraction_for_memory_says_capacity_needs_bytes(memory, capsys):
    """kvplug capacity looks at no device: a fraction (kvplug serve's --kv-memory 0.9) is refused
    with why, not with "must be positive" (issue 29 item 9)."""
    code = main(["capacity", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--memory", memory])
    error = capsys.readouterr().err
    assert code == 2 and f"got the fraction {memory!r}" in error and "positive" not in error
    assert main(["capacity", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--memory", "1MiB"]) == 0
