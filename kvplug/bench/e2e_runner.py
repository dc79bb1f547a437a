"""One measured run of ``kvplug bench e2e``: a workload through transformers' ``generate_batch``.

A variant is a kvplug prefix cache by name (``radix``, ``naive``, ...: kvplug installed through
``kvplug_transformers.TransformersHost``; decode steps replayed from kvplug's CUDA graphs on
CUDA), the same with ``:eager`` appended (kvplug's graphs off: every step eager), ``:sync``
(transformers' async batching off: each step waits for the previous one's outputs) or
``:compile`` (the model torch.compiled before kvplug captures it), ``:defer`` (a host-tier hit
waits outside the steps until its copy is done: ``KVPlugSettings.defer_host_loads``), or ``native`` (transformers'
own paged cache, with its default block sharing). ``+host`` after a kvplug cache (``radix+host``,
``radix+host:sync``) adds the host-memory tier of ``RunConfig.host_memory`` bytes. Every variant
gets the same pool size in tokens, page size, requests per step and tokens per step, so only the
KV cache differs.

Timing comes from transformers' per-request records (``record_timestamps=True``): a request's
``created_time`` (submission), the time of each generated token, and its finish time. TTFT is the
first token's time minus submission, latency the finish minus submission; both include queueing,
since a round submits all its requests at once. A round's serving time runs from its first
submission to its last finish, so manager start-up and teardown are outside it.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvplug.bench.e2e_workloads import Prompts, Workload, prompt_tokens

NATIVE = "native"
VARIANT_OPTIONS = ("eager", "sync", "compile", "defer")  # 'radix:eager' and so on (module docstring)
HOST_TIER_SUFFIX = "+host"


@dataclass(frozen=True)
class RunConfig:
    """What every variant of one measurement shares (all host-side values).

    Attributes:
        concurrency: requests per forward step (transformers' ``max_requests_per_batch``) and
            kvplug's request rows.
        page_size: tokens per KV page (transformers' block size).
        num_pages: pool pages (transformers' block count).
        max_seq_len: longest request in tokens (kvplug's page-table width).
        max_batch_tokens: tokens per forward step.
        output_tokens: tokens generated per request; EOS is disabled so every request makes exactly this many.
        attention: kvplug attention backend name (``auto``: torch on CPU, best GPU backend on CUDA).
        host_memory: bytes of the host-memory tier of ``+host`` variants (``None``: none may run).
    """

    concurrency: int
    page_size: int
    num_pages: int
    max_seq_len: int
    max_batch_tokens: int
    output_tokens: int
    attention: str = "auto"
    host_memory: int | None = None


@dataclass(frozen=True)
class RoundRecord:
    """Per-request times of one round, in seconds on the ``perf_counter`` clock (cpu)."""

    submitted: np.ndarray
    first_token: np.ndarray
    finished: np.ndarray
    prompt_tokens: int
    output_tokens: int
    tokens_digest: str

    @property
    def serve_s(self) -> float:
        return float(self.finished.max() - self.submitted.min())


def round_record(prompts: Prompts, outputs: Sequence[Any]) -> RoundRecord:
    """Times of a round from transformers' ``GenerationOutput``s (one per prompt, in order);
    a missing, failed or timestamp-less output is an error naming the request."""
    if len(outputs) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(outputs)} results for {len(prompts)} prompts")
    for output in outputs:
        if output.error is not None or not output.timestamps:
            raise RuntimeError(f"request {output.request_id} failed: error={output.error!r}, "
                               f"{len(output.timestamps or [])} token timestamps")
    return RoundRecord(
        submitted=np.array([output.created_time for output in outputs]),
        first_token=np.array([output.timestamps[0] for output in outputs]),
        finished=np.array([output.lifespan[1] for output in outputs]),
        prompt_tokens=prompt_tokens(prompts),
        output_tokens=sum(len(output.generated_tokens) for output in outputs),
        tokens_digest=_digest(repr([list(output.generated_tokens) for output in outputs])),
    )


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def summarize(rounds: Sequence[RoundRecord], wall_s: float) -> dict[str, float | int]:
    """Throughput over the summed serving time of the rounds; TTFT and latency percentiles over
    every request of every round, in milliseconds; a digest of every generated token (variants
    that compute the same thing in fp32 agree on it)."""
    serve_s = sum(record.serve_s for record in rounds)
    ttft = np.concatenate([record.first_token - record.submitted for record in rounds]) * 1e3
    latency = np.concatenate([record.finished - record.submitted for record in rounds]) * 1e3
    requests = int(ttft.size)
    prompt = sum(record.prompt_tokens for record in rounds)
    output = sum(record.output_tokens for record in rounds)
    return {
        "requests": requests, "prompt_tokens": prompt, "output_tokens": output,
        "serve_s": round(serve_s, 4), "wall_s": round(wall_s, 4),
        "req_per_s": round(requests / serve_s, 3),
        "output_tok_per_s": round(output / serve_s, 2),
        "total_tok_per_s": round((prompt + output) / serve_s, 2),
        "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 2), "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 2),
        "latency_p50_ms": round(float(np.percentile(latency, 50)), 2),
        "latency_p99_ms": round(float(np.percentile(latency, 99)), 2),
        "tokens_digest": _digest("".join(record.tokens_digest for record in rounds)),
    }


class VariantRunner:
    """Runs workloads on one model with one KV-cache variant and one ``RunConfig``."""

    def __init__(self, model: Any, variant: str, config: RunConfig) -> None:
        self.model, self.variant, self.config = model, variant, config

    def run(self, workload: Workload) -> dict[str, Any]:
        """Every round of ``workload``; a multi-round workload keeps one manager (and so one
        prefix cache) across its rounds. Returns ``summarize``'s figures plus cache counters."""
        import transformers

        persistent = workload.rounds > 1
        generation = transformers.GenerationConfig(
            max_new_tokens=self.config.output_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        host, installed = self._installed()
        records: list[RoundRecord] = []
        outputs: list[Any] = []
        wall_s = 0.0
        with installed:
            try:
                prompts = workload.first_round
                for turn in range(workload.rounds):
                    if turn:
                        answers = [list(output.generated_tokens) for output in outputs]
                        prompts = workload.next_round(turn, prompts, answers)
                    start = time.perf_counter()
                    results = self.model.generate_batch(
                        prompts, generation_config=generation, continuous_batching_config=self._cb_config(),
                        record_timestamps=True, persistent_manager=persistent)
                    wall_s += time.perf_counter() - start
                    outputs = list(results.values())
                    records.append(round_record(prompts, outputs))
            finally:
                if persistent:
                    self.model.destroy_cached_continuous_batching_manager()
        figures: dict[str, Any] = summarize(records, wall_s)
        if host is None:
            figures.update(hit_rate=None, cache_hit_tokens=None, evicted_tokens=None)
        else:
            stats = host.stats()
            figures.update(hit_rate=round(stats.hit_rate, 4), cache_hit_tokens=stats.cache_hit_tokens,
                           evicted_tokens=stats.evicted_tokens, attention=stats.attention,
                           device_hit_rate=round(stats.device_hit_rate, 4), host_hit_rate=round(stats.host_hit_rate, 4),
                           host_hit_tokens=stats.host_hit_tokens, host_loads=stats.host_loads,
                           host_loaded_bytes=stats.host_loaded_bytes, host_write_backs=stats.host_write_backs,
                           host_written_bytes=stats.host_written_bytes, host_dropped_tokens=stats.host_dropped_tokens,
                           host_reused_copy_tokens=stats.host_reused_copy_tokens)
        return figures

    def _installed(self) -> tuple[Any, contextlib.AbstractContextManager]:
        from kvplug_transformers.installation import is_installed

        if self.variant == NATIVE:
            if is_installed():
                raise RuntimeError("the native variant needs transformers' own cache, but kvplug is installed")
            return None, contextlib.nullcontext()
        from kvplug_transformers.host import TransformersHost

        config = self.config
        cache, _, option = self.variant.partition(":")
        if option and option not in VARIANT_OPTIONS:
            raise ValueError(f"unknown variant option {option!r} in {self.variant!r}; "
                             f"expected one of {', '.join(VARIANT_OPTIONS)}")
        host_memory = None
        if cache.endswith(HOST_TIER_SUFFIX):
            cache = cache.removesuffix(HOST_TIER_SUFFIX)
            host_memory = config.host_memory
            if host_memory is None:
                raise ValueError(f"variant {self.variant!r} needs a host-memory size (RunConfig.host_memory)")
        host = TransformersHost(prefix_cache=cache, attention=config.attention, page_size=config.page_size,
                                max_running_reqs=config.concurrency, max_seq_len=config.max_seq_len,
                                cuda_graphs=False if option == "eager" else None,
                                overlap_schedule=False if option == "sync" else None,
                                torch_compile=option == "compile", host_memory=host_memory,
                                defer_host_loads=option == "defer")
        return host, host.installed_context()

    def _cb_config(self) -> Any:
        import transformers

        config = self.config
        return transformers.ContinuousBatchingConfig(
            block_size=config.page_size, num_blocks=config.num_pages, max_batch_tokens=config.max_batch_tokens,
            max_requests_per_batch=config.concurrency)
