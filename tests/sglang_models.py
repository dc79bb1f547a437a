"""Tiny random checkpoints for the real-SGLang-server tests, built offline: Llama- and Qwen3-shaped.

Weights are random from a fixed seed and the tokenizer is byte-level (one token per UTF-8 byte)
with ChatML special tokens and chat template, so nothing is downloaded. The text they generate is
meaningless; what the tests compare is token ids, which are exact on the CPU in float32.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB = 256
PAD_TOKEN_ID = BYTE_VOCAB
EOS_TOKEN_ID = BYTE_VOCAB + 2
VOCAB_SIZE = 320  # bytes + specials, rounded up (the rest is never produced by the tokenizer)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # wide enough that greedy output depends on the whole prompt
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=PAD_TOKEN_ID,
    torch_dtype="float32",
)
SHAPES = ("llama", "qwen3")


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=_COMMON["max_position_embeddings"],
    )


def build_model(shape: str, directory: Path, seed: int = 1234) -> Path:
    """Write a ``shape`` (``"llama"`` or ``"qwen3"``) checkpoint with its tokenizer to ``directory``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        shape
    ]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config_class(**_COMMON)).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, do_sample=False)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory
