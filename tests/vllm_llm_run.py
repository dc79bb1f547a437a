"""One vLLM engine in this process (``LLM(...)``, in-process EngineCore), one workload, results as JSON.

Run by tests/test_vllm_host.py as ``python tests/vllm_llm_run.py MODEL_DIR CONFIG_JSON OUT_JSON``:
vLLM keeps process-wide state, so each engine gets a fresh interpreter. ``CONFIG_JSON`` names the
prefix cache (``"native"``: vLLM's own prefix caching, else a kvplug prefix-cache name through
``KvplugConnector``; ``"faulty"``: ``tests.faulty_cache``, its fault in ``extra.prefix_cache_options``)
and the workload:

- ``identity``: prompts of several hundred tokens sharing a 300-token prefix, submitted together
  and then again; the same token ids under another ``cache_salt``.
- ``pressure``: many long prompts sharing prefixes through a pool of a few dozen blocks, chunked
  prefill with a small token budget: vLLM preempts and kvplug evicts. With kvplug, block
  conservation is checked after every scheduling step.
- ``host``: 16 prompts with their own 3-block heads through a pool of 40 blocks, then again: with
  ``host_memory`` (``CONFIG_JSON``'s ``extra``) the first round's prefixes, evicted from the pool,
  come back from kvplug's host tier in the second.
- ``events``: prompts sharing prefixes, one at a time, then again, then under two ``cache_salt``
  values (the same token ids): what each namespace publishes.
- ``lora``: one prompt, one request at a time, under no adapter and two LoRA adapters
  (``CONFIG_JSON``'s ``inputs.adapters``: name -> PEFT directory), each twice, then under two
  ``cache_salt`` values (the first twice): a result per step in ``steps``.
- ``embeds``: prompts given as embeddings (``prompt_embeds``, rows of the model's embedding table)
  of one length, so their placeholder token ids are equal: two different ones, the first again, one
  sharing only the first's first block, then the first's token ids as a token prompt; ``steps``.

With ``"events": true`` in ``CONFIG_JSON`` vLLM's KV events are on (its ``null`` publisher): every
batch handed to the publisher goes through msgspec's encoder and vLLM's ``KVEventBatch`` decoder, as
a router receives it, and lands in the result's ``events`` (one list per batch, each event as msgspec's
builtins).

Greedy sampling in float32 on the CPU, so token ids are exact and comparable across runs.
"""

from __future__ import annotations

import json
import os
import random
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def prompts(workload: str) -> list[dict]:
    rng = random.Random(7)
    if workload == "identity":
        shared = [rng.randrange(256) for _ in range(300)]
        return [{"prompt_token_ids": shared + [rng.randrange(256) for _ in range(rng.randrange(40, 260))]}
                for _ in range(6)]
    if workload == "events":
        shared = [rng.randrange(256) for _ in range(300)]
        heads = [shared + [rng.randrange(256) for _ in range(130)] for _ in range(2)]
        plain = [{"prompt_token_ids": head} for head in heads]
        return plain + [dict(prompt, cache_salt=salt) for salt in ("tenant-a", "tenant-b") for prompt in plain]
    if workload == "host":
        return [{"prompt_token_ids": [rng.randrange(256) for _ in range(384 + rng.randrange(1, 60))]}
                for _ in range(16)]
    heads = [[rng.randrange(256) for _ in range(rng.choice((130, 260)))] for _ in range(3)]
    return [{"prompt_token_ids": rng.choice(heads) + [rng.randrange(256) for _ in range(rng.randrange(10, 140))]}
            for _ in range(16)]


def requests_of(workload: str, model: str, inputs: dict) -> list[tuple[str, dict, object]]:
    """``(label, prompt, LoRA request)`` of each request of the ``lora`` and ``embeds`` workloads."""
    rng = random.Random(7)
    if workload == "lora":
        from vllm.lora.request import LoRARequest

        prompt = {"prompt_token_ids": [rng.randrange(256) for _ in range(300)]}
        adapters = {name: LoRARequest(name, number, path)
                    for number, (name, path) in enumerate(sorted(inputs["adapters"].items()), start=1)}
        plain = [(f"{name or 'base'}-{repeat}", prompt, adapters.get(name))
                 for name in (None, *adapters) for repeat in (1, 2)]
        salted = [(f"{salt}-{repeat}", dict(prompt, cache_salt=salt), None)
                  for salt, repeat in (("tenant-a", 1), ("tenant-b", 1), ("tenant-a", 2))]
        return plain + salted
    import torch
    from safetensors.torch import load_file

    table = load_file(os.path.join(model, "model.safetensors"))["model.embed_tokens.weight"]
    first, second = ([rng.randrange(256) for _ in range(300)] for _ in range(2))
    shares_a_block = first[:128] + second[128:]
    embedded = {name: {"prompt_embeds": table[torch.tensor(ids)].clone()}
                for name, ids in (("first", first), ("second", second), ("shares-a-block", shares_a_block))}
    return [("first", embedded["first"], None), ("second", embedded["second"], None),
            ("first-again", {"prompt_embeds": embedded["first"]["prompt_embeds"].clone()}, None),
            ("shares-a-block", embedded["shares-a-block"], None), ("first-as-tokens", {"prompt_token_ids": first}, None)]


def main() -> None:
    model, config_text, out_path = sys.argv[1:4]
    config = json.loads(config_text)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    workload = config["workload"]
    kwargs = dict(model=model, dtype="float32", max_model_len=2048, distributed_executor_backend="uni",
                  enable_prefix_caching=True, seed=0, enforce_eager=True)
    if workload == "identity":
        kwargs.update(max_num_seqs=8, kv_cache_memory_bytes=64 << 20)
    elif workload == "events":
        kwargs.update(max_num_seqs=4, kv_cache_memory_bytes=64 << 20)
    elif workload == "lora":
        kwargs.update(max_num_seqs=4, kv_cache_memory_bytes=64 << 20, enable_lora=True, max_lora_rank=8, max_loras=2)
    elif workload == "embeds":
        kwargs.update(max_num_seqs=4, kv_cache_memory_bytes=64 << 20, enable_prompt_embeds=True)
    elif workload == "host":  # 40 blocks of 128 tokens (1 KiB of KV per token)
        kwargs.update(max_num_seqs=4, kv_cache_memory_bytes=40 * 128 * 1024)
    else:  # ~40 blocks of 128 tokens (1 KiB of KV per token), chunked prefill of 256 tokens
        kwargs.update(max_num_seqs=16, kv_cache_memory_bytes=40 * 128 * 1024, max_num_batched_tokens=256,
                      enable_chunked_prefill=True)
    if config["cache"] == "faulty":  # tests/faulty_cache.py, as an installed plugin would register it
        from kvplug.plugins import default_manager
        from tests.faulty_cache import FaultyCachePlugin

        default_manager().register(FaultyCachePlugin(), "faulty-cache-vllm-tests")
    if config["cache"] != "native":
        extra = {"prefix_cache": config["cache"], **config.get("extra", {})}
        kwargs["kv_transfer_config"] = KVTransferConfig(kv_connector="KvplugConnector", kv_role="kv_both",
                                                        kv_connector_extra_config=extra)
    if config.get("events"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    llm = LLM(**kwargs)
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    manager = scheduler.kv_cache_manager
    checks = {"steps": 0, "preemptions": 0}
    preempt = scheduler._preempt_request

    def counted_preempt(*args, **kw):
        checks["preemptions"] += 1
        return preempt(*args, **kw)

    scheduler._preempt_request = counted_preempt
    published: list = []
    if config.get("events"):
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(type=KVEventBatch)
        publisher = scheduler.kv_event_publisher

        def recorded_publish(batch):
            published.append([msgspec.to_builtins(event) for event in decoder.decode(encoder.encode(batch)).events])
            return publisher.__class__.publish(publisher, batch)

        publisher.publish = recorded_publish
    if config["cache"] != "native":
        schedule = scheduler.schedule

        def checked_schedule(*args, **kw):
            output = schedule(*args, **kw)
            manager.check_conservation()
            checks["steps"] += 1
            return output

        scheduler.schedule = checked_schedule
    max_tokens = {"identity": 12, "host": 8, "events": 4, "lora": 8, "embeds": 8}.get(workload, 240)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sequence = requests_of(workload, model, config.get("inputs", {})) if workload in ("lora", "embeds") else None
    batch = prompts(workload) if sequence is None else []
    rounds, done = [], []
    for label, prompt, lora in sequence or ():
        output = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0]
        done.append({"label": label, "tokens": list(output.outputs[0].token_ids), "cached": output.num_cached_tokens})
    for _ in range(2 if sequence is None else 0):
        if workload == "events":  # one at a time: the order of events is the order of the prompts
            outputs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in batch]
        else:
            outputs = llm.generate(batch, params, use_tqdm=False)
        rounds.append({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                       "cached": [o.num_cached_tokens for o in outputs]})
    result = {"rounds": rounds, "steps": done, "manager": type(manager).__name__, "checks": checks,
              "pool_hash_entries": len(manager.block_pool.cached_block_hash_to_block)}
    if workload == "identity":
        salted = [dict(prompt, cache_salt="tenant-b") for prompt in batch]
        outputs = llm.generate(salted, params, use_tqdm=False)
        result["salted"] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                            "cached": [o.num_cached_tokens for o in outputs]}
    if config["cache"] != "native":
        recorder = scheduler.connector._events
        result["unmatched_pages"] = recorder.unmatched_pages if recorder is not None else None
        result["kvplug"] = scheduler.connector.snapshot()
        result["reset"] = llm.reset_prefix_cache()
        result["after_reset"] = scheduler.connector.snapshot()
        manager.check_conservation()
    if config.get("events"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)  # publishes the reset's events
        result["events"] = published
    with open(out_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
