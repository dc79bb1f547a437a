"""One measured run of ``kvplug bench e2e``: its configuration, variants, and the metric arithmetic.

A variant is a kvplug prefix cache by name (``radix``, ``naive``, ...; decode steps replayed from
kvplug's CUDA graphs on CUDA), the same with ``:eager`` appended (kvplug's graphs off: every step
eager), ``:sync`` (the host's async batching off: each step waits for the previous one's
outputs), ``:compile`` (the model torch.compiled before kvplug captures it) or ``:defer`` (a
host-tier hit waits outside the steps until its copy is done), or ``native`` (the host's own
paged cache). ``+host`` after a kvplug cache (``radix+host``, ``radix+host:sync``) adds the
host-memory tier of ``RunConfig.host_memory`` bytes. Every variant gets the same pool size in
tokens, page size, requests per step and tokens per step, so only the KV cache differs. The host
runs the rounds (``kvplug.bench.e2e_host.E2EHost``; the transformers adapter's lives in its
``e2e_bench`` module).

Timing comes from the host's per-request records: a request's submission time, the time of each
generated token, and its finish time. TTFT is the first token's time minus submission, latency the
finish minus submission; both include queueing, since a round submits all its requests at once. A
round's serving time runs from its first submission to its last finish, so manager start-up and
teardown are outside it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from kvplug.bench.e2e_workloads import Prompts, prompt_tokens

NATIVE = "native"
VARIANT_OPTIONS = ("eager", "sync", "compile", "defer")  # 'radix:eager' and so on (module docstring)
HOST_TIER_SUFFIX = "+host"


class Variant(NamedTuple):
    """A parsed variant name: ``cache`` (a kvplug prefix cache, or ``native``), ``option`` (one of
    ``VARIANT_OPTIONS`` or ``""``) and whether it adds the host-memory tier."""

    cache: str
    option: str
    host_tier: bool

    @property
    def native(self) -> bool:
        return self.cache == NATIVE


def parse_variant(variant: str) -> Variant:
    """``"radix+host:sync"`` → ``Variant("radix", "sync", True)``; an unknown option or a tier on
    ``native`` is an ``InvalidArgumentError``."""
    from kvplug.interface.errors import InvalidArgumentError

    cache, _, option = variant.partition(":")
    if option and option not in VARIANT_OPTIONS:
        raise InvalidArgumentError(f"unknown variant option {option!r} in {variant!r}; "
                                   f"expected one of {', '.join(VARIANT_OPTIONS)}")
    host_tier = cache.endswith(HOST_TIER_SUFFIX)
    cache = cache.removesuffix(HOST_TIER_SUFFIX)
    if not cache:
        raise InvalidArgumentError(f"variant {variant!r} names no prefix cache")
    if cache == NATIVE and (option or host_tier):
        raise InvalidArgumentError(f"variant {variant!r}: the native cache takes no option or host tier")
    return Variant(cache, option, host_tier)


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
    """Times of a round from the host's per-request outputs (one per prompt, in order), each with
    ``request_id``, ``error``, ``created_time``, ``timestamps`` (one per generated token),
    ``lifespan`` (``(start, finish)``) and ``generated_tokens`` - the fields of transformers'
    ``GenerationOutput``; a missing, failed or timestamp-less output is an error naming the request."""
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
