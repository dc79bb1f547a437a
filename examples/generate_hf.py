"""Generate with a Hugging Face model whose continuous-batching KV cache is kvplug.

    pip install ./adapters/transformers
    python examples/generate_hf.py [LOCAL_MODEL_DIR]   # default: kvplug's embedded model (random weights)
"""

import sys

from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import kvplug_transformers
from kvplug_transformers.embedded_model import ensure_embedded_model

path = sys.argv[1] if len(sys.argv) > 1 else str(ensure_embedded_model())  # its text output is meaningless
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()  # on a GPU add device_map="cuda"
kvplug_transformers.install(prefix_cache="radix", attention="auto", page_size=16, kv_memory=256 << 20)

system = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}
questions = ["What is a KV cache?", "Why allocate it in pages?", "What does a radix tree store?"]
prompts = [tokenizer.apply_chat_template([system, {"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"] for q in questions]
config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
for round_ in ("first", "second"):  # the kept manager's radix cache serves the second round's prompts
    outputs = model.generate_batch(prompts, generation_config=config, persistent_manager=True)
    for question, output in zip(questions, outputs.values()):
        print(f"[{round_}] {question} -> {tokenizer.decode(output.generated_tokens, skip_special_tokens=True)!r}")
    print(kvplug_transformers.stats().describe())
model.destroy_cached_continuous_batching_manager()
