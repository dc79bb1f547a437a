"""The embedded default model of ``kvplug serve``: a small Qwen3-shaped checkpoint, built offline.

Its weights are random (drawn from a fixed seed) and its tokenizer is byte-level with a ChatML
chat template, so nothing is downloaded, ever. It exists to exercise the serving path end to end
(tokenise, schedule, page, prefix-cache, attend, sample, detokenise); **the text it generates is
meaningless** — random bytes, not language.

The checkpoint is written once to ``<cache>/embedded-default-<hash>`` (``<cache>`` is
``$KVPLUG_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvplug``, else ``~/.cache/kvplug``); the hash covers
everything that determines its content, so a change of spec gets a new directory. The directory
is built under a temporary name and renamed into place, so concurrent builders never see half a
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

SPEC_VERSION = 1
MARKER_FILE = "kvplug-embedded.json"
SEED = 20240607

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB_SIZE = 256
VOCAB_SIZE = BYTE_VOCAB_SIZE + len(SPECIAL_TOKENS)
PAD_TOKEN_ID = BYTE_VOCAB_SIZE  # <|endoftext|>
EOS_TOKEN_ID = BYTE_VOCAB_SIZE + 2  # <|im_end|>

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MODEL_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,  # a size every GPU attention backend supports
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,  # wide enough that greedy output varies with the prompt
    "tie_word_embeddings": True,
    "bos_token_id": None,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
}

EMBEDDED_MODEL_NAME = "kvplug/embedded-default"


def spec() -> dict:
    """Everything that determines the checkpoint's bytes."""
    return {
        "spec_version": SPEC_VERSION,
        "seed": SEED,
        "model_config": MODEL_CONFIG,
        "special_tokens": list(SPECIAL_TOKENS),
        "chat_template": CHAT_TEMPLATE,
    }


def spec_hash() -> str:
    return hashlib.sha256(json.dumps(spec(), sort_keys=True).encode()).hexdigest()[:16]


def cache_root() -> Path:
    explicit = os.environ.get("KVPLUG_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvplug"


def embedded_model_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / f"embedded-default-{spec_hash()}"


def is_complete(directory: Path) -> bool:
    marker = directory / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == spec()
    except (OSError, ValueError):
        return False


def ensure_embedded_model(root: Path | None = None) -> Path:
    """Path of the embedded checkpoint, building it first if it is not on disk yet."""
    target = embedded_model_dir(root)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build_tokenizer().save_pretrained(staging)
        build_model().save_pretrained(staging)
        (staging / MARKER_FILE).write_text(json.dumps(spec(), sort_keys=True, indent=2))
        if target.exists() and not is_complete(target):
            shutil.rmtree(target, ignore_errors=True)  # a half-written directory from a crashed build
        try:
            os.replace(staging, target)
        except OSError:
            if not is_complete(target):  # lost a race to a builder that failed: surface our error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tokenizer():
    """A byte-level tokenizer (one token per UTF-8 byte) plus the ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # the byte-level alphabet maps each of the 256 bytes to one printable character
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
    )


def build_model():
    """The Qwen3-shaped model with weights drawn from ``SEED`` (float32, on the CPU)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    fields = {key: value for key, value in MODEL_CONFIG.items() if key not in ("architectures", "model_type")}
    config = Qwen3Config(**fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, do_sample=False, max_new_tokens=64
    )
    return model
