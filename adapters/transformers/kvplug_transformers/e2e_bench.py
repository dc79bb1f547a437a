"""The transformers side of ``kvplug bench e2e``: workloads through ``generate_batch``.

``kvplug bench e2e`` never imports this package: it looks the ``transformers`` host up through the
plugin manager and calls ``TransformersHost.e2e_bench()``, which returns a ``TransformersE2E``
(a ``kvplug.bench.e2e_host.E2EHost``). A kvplug variant installs kvplug through a
``TransformersHost`` with the variant's settings for its rounds; ``native`` runs transformers' own
paged cache (its default block sharing on). Timing comes from transformers' per-request records
(``record_timestamps=True``): ``created_time``, one timestamp per generated token, ``lifespan``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from kvplug.bench.e2e_host import BenchModel, E2EHost
from kvplug.bench.e2e_model import MODEL_SHAPES, SEED, ModelShapeSpec
from kvplug.bench.e2e_runner import RoundRecord, RunConfig, parse_variant, round_record, summarize
from kvplug.bench.e2e_workloads import Workload
from kvplug.interface.errors import InvalidArgumentError
from kvplug.memory.model_shape import ModelShape


def build_model(shape_name: str, device: torch.device, dtype: torch.dtype, *, seed: int = SEED) -> Any:
    """A ``Qwen3ForCausalLM`` of ``MODEL_SHAPES[shape_name]`` with random weights, in eval mode,
    on ``device`` in ``dtype``.

    ``initializer_range`` is widened so greedy decoding does not collapse onto one token, which
    would make every answer (and so every multi-turn prompt) the same.
    """
    if shape_name not in MODEL_SHAPES:
        raise InvalidArgumentError(f"unknown model shape {shape_name!r}; expected one of {sorted(MODEL_SHAPES)}")
    return _build(MODEL_SHAPES[shape_name], device, dtype, seed)


def _build(spec: ModelShapeSpec, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    import transformers

    config = transformers.Qwen3Config(
        **spec._asdict(),
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config)
    return model.to(dtype=dtype).eval()


class VariantRunner:
    """Runs workloads on one transformers model with one KV-cache variant and one ``RunConfig``."""

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
        from kvplug_transformers.host import TransformersHost
        from kvplug_transformers.installation import is_installed

        variant = parse_variant(self.variant)
        if variant.native:
            if is_installed():
                raise InvalidArgumentError("the native variant needs transformers' own cache, but kvplug is installed")
            return None, contextlib.nullcontext()
        config = self.config
        host_memory = None
        if variant.host_tier:
            host_memory = config.host_memory
            if host_memory is None:
                raise InvalidArgumentError(f"variant {self.variant!r} needs a host-memory size (RunConfig.host_memory)")
        option = variant.option
        host = TransformersHost(prefix_cache=variant.cache, attention=config.attention, page_size=config.page_size,
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


class TransformersE2E(E2EHost):
    """``kvplug bench e2e`` on transformers' continuous batching (``TransformersHost.e2e_bench()``)."""

    def __init__(self) -> None:
        from kvplug_transformers.compat import require_transformers

        self._version = require_transformers().version  # the gate: refuse an unchecked release up front

    def build_model(self, shape_name: str, spec: ModelShapeSpec, seed: int, device: torch.device,
                    dtype: torch.dtype) -> BenchModel:
        model = _build(spec, device, dtype, seed)
        return BenchModel(model, model.config.vocab_size, ModelShape.from_hf_config(model.config, dtype))

    def run_variant(self, model: BenchModel, variant: str, config: RunConfig, workload: Workload) -> dict[str, Any]:
        return VariantRunner(model.model, variant, config).run(workload)

    def versions(self) -> dict[str, str]:
        return {"transformers": self._version}
