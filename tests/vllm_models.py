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


LORA_TARGETS = ("q_proj", "v_proj")


def build_lora(directory: Path, seed: int, rank: int = 8) -> Path:
    """Write a PEFT LoRA adapter for the model ``build_model`` writes (q_proj and v_proj of every
    layer, rank ``rank``) to ``directory`` (returned), by hand: peft is not needed. B is random and
    large (PEFT starts it at zero) so the adapter changes greedy outputs."""
    import json

    import torch
    from safetensors.torch import save_file

    head_dim = _CONFIG["head_dim"]
    out_features = {"q_proj": _CONFIG["num_attention_heads"] * head_dim,
                    "v_proj": _CONFIG["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(_CONFIG["num_hidden_layers"]):
        for target in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, _CONFIG["hidden_size"], generator=generator) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features[target], rank, generator=generator) * 0.2
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "target_modules": list(LORA_TARGETS), "bias": "none",
              "fan_in_fan_out": False, "modules_to_save": None, "base_model_name_or_path": None}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory
