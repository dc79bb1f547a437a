"""A tiny random Llama-shaped checkpoint for the vLLM-host tests, built offline.

vLLM's CPU attention takes head sizes 32, 64, 80, ... only, so the heads are 32 wide; weights are
random from a fixed seed, in float32, and the tokenizer is byte-level (one token per UTF-8 byte)
with ChatML specials, so nothing is downloaded. What the tests compare is token ids.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB = 256
PAD_TOKEN_ID = BYTE_VOCAB
EOS_TOKEN_ID = BYTE_VOCAB + 2
VOCAB_SIZE = 320
MAX_POSITIONS = 4096
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=MAX_POSITIONS,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # wide enough that greedy output depends on the whole prompt
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=PAD_TOKEN_ID,
    torch_dtype="float32",
)


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
        model_max_length=MAX_POSITIONS,
    )


def build_model(directory: Path, seed: int = 1234) -> Path:
    """Write the checkpoint and its tokenizer to ``directory`` (returned)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**_CONFIG)).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, do_sample=False)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory
