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
    if workload == "host":
        return [{"prompt_token_ids": [rng.randrange(256) for _ in range(384 + rng.randrange(1, 60))]}
                for _ in range(16)]
    heads = [[rng.randrange(256) for _ in range(rng.choice((130, 260)))] for _ in range(3)]
    return [{"prompt_token_ids": rng.choice(heads) + [rng.randrange(256) for _ in range(rng.randrange(10, 140))]}
            for _ in range(16)]


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
    if config["cache"] != "native":
        schedule = scheduler.schedule

        def checked_schedule(*args, **kw):
            output = schedule(*args, **kw)
            manager.check_conservation()
            checks["steps"] += 1
            return output

        scheduler.schedule = checked_schedule
    params = SamplingParams(temperature=0, max_tokens={"identity": 12, "host": 8}.get(workload, 240), ignore_eos=True)
    batch = prompts(workload)
    rounds = []
    for _ in range(2):
        outputs = llm.generate(batch, params, use_tqdm=False)
        rounds.append({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                       "cached": [o.num_cached_tokens for o in outputs]})
    result = {"rounds": rounds, "manager": type(manager).__name__, "checks": checks,
              "pool_hash_entries": len(manager.block_pool.cached_block_hash_to_block)}
    if workload == "identity":
        salted = [dict(prompt, cache_salt="tenant-b") for prompt in batch]
        outputs = llm.generate(salted, params, use_tqdm=False)
        result["salted"] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                            "cached": [o.num_cached_tokens for o in outputs]}
    if config["cache"] != "native":
        result["kvplug"] = scheduler.connector.snapshot()
        result["reset"] = llm.reset_prefix_cache()
        result["after_reset"] = scheduler.connector.snapshot()
        manager.check_conservation()
    with open(out_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
