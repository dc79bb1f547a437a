"""The version gate: every transformers internal the adapter touches, in one table, checked at install.

``INTERNALS`` lists each private name of transformers' continuous batching that kvplug replaces
(*patched*), reads, calls, re-implements a part of, or stands in for (*implemented*), with why
and a fingerprint of the pinned release (``PINNED_VERSION``): its parameter names, the hash of
its source, what each position of a returned tuple holds, that the class sets an instance
attribute, or that a dataclass has the fields read. ``require_transformers()`` refuses a version
outside ``SUPPORTED_RANGE`` and then recomputes every fingerprint, failing with one error that
names each entry that drifted: a silent mismatch would corrupt the KV cache rather than fail.
``KVPLUG_TRANSFORMERS_SKIP_VERSION_CHECK=1`` skips the version comparison only (for porting to a
new release; the fingerprints still say what changed). The adapter README's table is generated
from ``INTERNALS`` (``internals_table_markdown``; a test keeps them equal).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

from kvplug import host_internals
from kvplug.host_internals import (  # noqa: F401  (the checks, re-exported for the table below and tests)
    ASSIGNED, FIELDS, INTERFACE, MEMBERS, ORIGINAL_ATTRIBUTE, PARAMETERS, RETURNS, SOURCE, HostInternal, resolve,
)
from kvplug.interface import KVPlugError

MIN_VERSION = (5, 17, 0)
MAX_VERSION_EXCLUSIVE = (5, 18, 0)
SUPPORTED_RANGE = ">=5.17.0,<5.18"
PINNED_VERSION = "5.17.0"  # the release whose source the fingerprints below were taken from
SKIP_CHECK_ENV = "KVPLUG_TRANSFORMERS_SKIP_VERSION_CHECK"
INSTALL_HINT = "pip install 'transformers>=5.17.0,<5.18'"

PATCHED, READ, CALLED, REIMPLEMENTED, IMPLEMENTED = "patched", "read", "called", "re-implemented", "implemented"
KINDS = (PATCHED, READ, CALLED, REIMPLEMENTED, IMPLEMENTED)

_CB = "transformers.generation.continuous_batching"
_SERVING = "transformers.cli.serving"


class UnsupportedTransformersError(KVPlugError, ImportError):
    """transformers is missing, or its version/internals are not the ones the adapter was written for."""


@dataclass(frozen=True)
class Internal(HostInternal):
    """One transformers internal the adapter touches (``kvplug.host_internals.HostInternal``); ``kind``
    is ``patched`` (kvplug replaces it while installed), ``read``, ``called``, ``re-implemented``
    (kvplug runs its own copy of part of it) or ``implemented`` (kvplug's stand-in provides the same
    interface)."""

    @property
    def short_name(self) -> str:
        """``ModelRunner.compute_batch``: the path without ``transformers.generation.continuous_batching.``."""
        return self.name.removeprefix(f"{_CB}.").removeprefix("transformers.")


INTERNALS: tuple[Internal, ...] = (
    # ---- replaced while installed (installation.install_patches)
    Internal(f"{_CB}.continuous_api", "PagedAttentionCache", PATCHED,
             "the class ContinuousBatchingManager instantiates; becomes a factory building KVPlugPagedCache "
             "(same constructor arguments)",
             PARAMETERS, "self, config, continuous_batching_config, device, distributed_helper, tp_plan, dtype"),
    Internal(f"{_CB}.continuous_api.ContinuousBatchingManager", "switch_to_cb_friendly_attn", PATCHED,
             "selects paged|kvplug and remembers the model's own implementation, which stop() restores",
             PARAMETERS, "self, model"),
    Internal(f"{_CB}.model_runner.ModelRunner", "compute_batch", PATCHED,
             "a decode-only step that fits a captured size replays kvplug's CUDA graph; every step is then "
             "committed on the device (KVPlugPagedCache.step_launched); other steps call the original",
             PARAMETERS, "self, model, batch_data"),
    Internal(f"{_CB}.model_runner.ModelRunner", "warmup", PATCHED,
             "the original, then kvplug captures its decode graphs before the manager takes requests",
             PARAMETERS, "self, model"),
    Internal(f"{_CB}.scheduler.Scheduler", "add_waiting_request", PATCHED,
             "kvplug refuses a prompt that leaves no room in max_seq_len and caps max_new_tokens, then the original",
             PARAMETERS, "self, state"),
    Internal(f"{_CB}.scheduler.Scheduler", "_process_candidates", PATCHED,
             "the original; when it scheduled nothing while host-tier loads are deferred, waits for them "
             "and runs it again with those requests first",
             PARAMETERS, "self, candidates, token_budget, cache_budget, request_ids_to_remove_from_waiting"),
    Internal(f"{_CB}.continuous_api.ContinuousBatchingManager", "add_request", PATCHED,
             "kvplug first starts the shared KV store's prefetch of the prompt (KVPlugPagedCache.prefetch, issue 30: "
             "on the caller's thread, before the scheduler admits the request), then the original",
             PARAMETERS, "self, input_ids, request_id, max_new_tokens, streaming, record_timestamps, eos_token_id, "
             "**logit_processor_kwargs"),
    Internal(f"{_CB}.continuous_api.ContinuousBatchProcessor", "prepare_next_batch", PATCHED,
             "kvplug first runs what waits for the batching thread (kvplug serve's decode-graph warm-up, a "
             "requested prefix-cache flush, the KV events of the pass before), then the original",
             PARAMETERS, "self"),
    Internal(f"{_CB}.scheduler.Scheduler", "_process_candidates", READ,
             "position 0 of its result is the list of scheduled requests (empty: nothing scheduled)",
             RETURNS, "(scheduled_requests, one_allocation_failed, decode_fast_path, num_q_tokens, max_kv_read)"),
    Internal(f"{_CB}.model_runner.ModelRunner", "_sample", PATCHED,
             "with kvplug serve's per-request sampling the kvplug cache samples each row with its request's "
             "settings (KVPlugPagedCache.sample_step); otherwise the original. With --kv-backend native "
             "(native_installation) the rows of requests that sent sampling fields are kvplug's "
             "(NativeStepSampler), the others the original's",
             PARAMETERS, "self, scores, output_ids"),
    # ---- called
    Internal(f"{_CB}.cache", "group_layers_by_attn_type", CALLED,
             "KVPlugPagedCache refuses models whose layers are not all full attention",
             PARAMETERS, "config"),
    Internal("transformers.modeling_utils.AttentionInterface", "register", CALLED,
             "registers the paged|kvplug attention function",
             PARAMETERS, "cls, key, value"),
    Internal(f"{_CB}.model_runner.ModelRunner", "_sample", CALLED,
             "samples a replayed decode step's logits into the step's output_ids, as an eager step does (through "
             "kvplug's replacement)",
             PARAMETERS, "self, scores, output_ids"),
    Internal(f"{_CB}.cb_logits_processors.ContinuousBatchingLogitsProcessorList", "__call__", CALLED,
             "runs transformers' logits processors over a replayed decode step's logits",
             PARAMETERS, "self, input_ids, scores, logits_processor_args"),
    Internal("transformers.generation.utils.GenerationMixin", "_get_logits_processor", CALLED,
             "--kv-backend native: the worker's processors, built as ContinuousBatchingManager builds them, tell "
             "which ones apply to every row (a request with its own sampling is then a 400)",
             PARAMETERS, "self, generation_config, input_ids_seq_length, encoder_input_ids, prefix_allowed_tokens_fn, "
             "logits_processor, device, model_kwargs, negative_prompt_ids, negative_prompt_attention_mask"),
    Internal(f"{_CB}.cb_logits_processors.ContinuousBatchingLogitsProcessorList", "__init__", CALLED,
             "--kv-backend native: the same list with per-request versions on, as the worker runs it",
             PARAMETERS, "self, logits_processor, per_request_processors, drop_unsupported_processors"),
    Internal(f"{_CB}.continuous_api.ContinuousBatchingManager", "add_request", CALLED,
             "--kv-backend native: wrapped on the manager instance (its class untouched) to give a request kvplug "
             "samples neutral per-request temperature / top_k / top_p (logit_processor_kwargs)",
             PARAMETERS, "self, input_ids, request_id, max_new_tokens, streaming, record_timestamps, eos_token_id, "
             "**logit_processor_kwargs"),
    Internal(f"{_CB}.continuous_api.ContinuousBatchingManager", "cancel_request", CALLED,
             "--kv-backend native: wrapped on the manager instance so a cancelled request's sampling state is freed",
             PARAMETERS, "self, request_id"),
    # ---- re-implemented in part
    Internal(f"{_CB}.model_runner.ModelRunner", "_forward_process_and_sample", REIMPLEMENTED,
             "after a graph replay kvplug runs its tail (float logits, logits processors, _sample); it cannot be "
             "called through: it runs the model's forward itself",
             SOURCE, "ef713c18ac82e9c2"),
    Internal(f"{_SERVING}.chat_completion.ChatCompletionHandler", "_build_chunk_sse", REIMPLEMENTED,
             "kvplug serve writes the per-token chunks (a content, reasoning or role delta) without pydantic, byte for "
             "byte the same (sse_chunks.ChatChunkBuilder, on the handler instance); every other chunk calls it",
             SOURCE, "04d2a61e208ea779"),
    Internal(f"{_SERVING}.utils.BaseHandler", "chunk_to_sse", REIMPLEMENTED,
             "the SSE framing and JSON dump (exclude_none) ChatChunkBuilder writes the same way",
             SOURCE, "c77ce0d71647a425"),
    # ---- read
    Internal(f"{_SERVING}.chat_completion.ChatCompletionHandler", "_streaming", READ,
             "reads its stream queue through get / get_nowait only and builds one chunk per item: kvplug serve's "
             "CoalescedQueue joins the text pieces already waiting",
             SOURCE, "34f300db7dbb3cbd"),
    Internal(f"{_CB}.model_runner.ModelRunner", "logit_processor", READ,
             "the step's logits processors (decode graphs)", ASSIGNED, "self.logit_processor set by the class"),
    Internal(f"{_CB}.model_runner.ModelRunner", "return_logprobs", READ,
             "whether kvplug's sampler also writes the sampled ids' log-probabilities (output_ids row 1)",
             ASSIGNED, "self.return_logprobs set by the class"),
    Internal(f"{_CB}.requests.RequestState", "status", READ,
             "PENDING when free_blocks comes from a soft reset (the request is queued again): its sampling "
             "state (seeded stream, penalty counts) is kept; --kv-backend native frees it once FINISHED / FAILED",
             SOURCE, "cc6bd89991cdccef"),
    Internal(f"{_CB}.continuous_api.ContinuousBatchProcessor", "update_batch", READ,
             "calls the cache's mark_shareable_blocks_as_complete right after a request's token is appended: "
             "kvplug ends a request whose output holds a stop string there",
             SOURCE, "4d6acc33c739cac2"),
    Internal(f"{_CB}.requests.RequestState", "update_and_check_completion", READ,
             "a request finishes once it holds _new_tokens_limit generated tokens: how a stop string ends it",
             SOURCE, "9f7ab8ccac6c5bc5"),
    Internal(f"{_CB}.model_runner.ModelRunner", "inputs_and_outputs", READ,
             "the step's static buffers and compute stream", ASSIGNED, "self.inputs_and_outputs set by the class"),
    Internal(f"{_CB}.model_runner.ModelRunner", "cache", READ,
             "finds the kvplug cache behind a step (patched compute_batch, warmup)", ASSIGNED,
             "self.cache set by the class"),
    Internal(f"{_CB}.continuous_api.ContinuousBatchProcessor", "cache", READ,
             "finds the kvplug cache behind a scheduling pass (patched prepare_next_batch)", ASSIGNED,
             "self.cache set by the class"),
    Internal(f"{_CB}.continuous_api.ContinuousBatchProcessor", "model_runner", READ,
             "the runner whose compute stream a warm-up asked for between passes captures the decode graphs on",
             ASSIGNED, "self.model_runner set by the class"),
    Internal(f"{_CB}.scheduler.Scheduler", "cache", READ,
             "finds the kvplug cache behind a scheduling pass", ASSIGNED, "self.cache set by the class"),
    Internal(f"{_CB}.cb_logits_processors.ContinuousBatchingLogitsProcessorList", "do_processing", READ,
             "whether a replayed step's logits go through the processors; per-request sampling refuses a worker "
             "that has any", ASSIGNED,
             "self.do_processing set by the class"),
    Internal(f"{_CB}.input_outputs.ContinuousBatchingIOs", "compute_stream", READ,
             "kvplug orders its table and token-pool writes on transformers' compute stream", ASSIGNED,
             "self.compute_stream set by the class"),
    Internal(f"{_CB}.input_outputs.ContinuousBatchingAsyncIOs", "compute_stream", READ,
             "the same with async batching", ASSIGNED, "self.compute_stream set by the class"),
    Internal(f"{_CB}.input_outputs.ContinuousBatchingIOs", "output_ids", READ,
             "the step's sampled ids, shape [1 or 2, max_batch_tokens + 1], int32, device (decode graphs)",
             ASSIGNED, "self.output_ids set by the class"),
    Internal(f"{_CB}.input_outputs.ContinuousBatchingAsyncIOs", "output_ids", READ,
             "the same with async batching: a property giving the current pair's device output ids",
             SOURCE, "2705012ff1bb768e"),
    Internal(f"{_CB}.requests", "RequestState", READ,
             "a new request's prompt and token limits (check_waiting_request caps them); at finish its prompt and "
             "generated ids tell kvplug which sampled ids to cache", FIELDS,
             "request_id, initial_tokens, generated_tokens, max_new_tokens, _new_tokens_limit"),
    Internal("transformers.generation.configuration_utils", "ContinuousBatchingConfig", READ,
             "pool sizing is read, and transformers' own graphs, compile, offloading and decode fast path are "
             "turned off, async batching set; --kv-backend native sets per_request_processors", FIELDS,
             "num_blocks, block_size, max_batch_tokens, max_memory_percent, use_cuda_graph, use_async_batching, "
             "varlen_compile_config, decode_compile_config, max_blocks_per_request, cpu_offload_space, "
             "per_request_processors"),
    Internal(f"{_CB}.continuous_api.ContinuousBatchingManager", "_original_attn_impl", READ,
             "the patched switch_to_cb_friendly_attn records the model's implementation where stop() reads it",
             ASSIGNED, "self._original_attn_impl set by the class"),
    Internal(f"{_CB}.input_outputs.ContinuousBatchingIOs", "prepare_batch_tensors", READ,
             "--kv-backend native: a step's logits rows are its requests_in_batch that have a new token, in order "
             "(NativeStepSampler maps rows to requests so)", SOURCE, "50a0da9301a27d0d"),
    Internal(f"{_CB}.input_outputs.ContinuousBatchingIOs", "requests_in_batch", READ,
             "--kv-backend native: the step's requests (FutureRequestState), in batch order", ASSIGNED,
             "self.requests_in_batch set by the class"),
    Internal(f"{_CB}.input_outputs.ContinuousBatchingAsyncIOs", "io_pairs", READ,
             "--kv-backend native with async batching: the pairs whose current one holds the step's requests",
             ASSIGNED, "self.io_pairs set by the class"),
    Internal(f"{_CB}.input_outputs.ContinuousBatchingAsyncIOs", "current_pair", READ,
             "the pair of the step being computed", ASSIGNED, "self.current_pair set by the class"),
    Internal(f"{_CB}.input_outputs.HostDeviceIOPair", "host_io", READ,
             "the pair's host-side ContinuousBatchingIOs (its requests_in_batch)", ASSIGNED,
             "self.host_io set by the class"),
    Internal(f"{_CB}.requests.FutureRequestState", "__init__", READ,
             "--kv-backend native: a step entry's state (RequestState) and has_new_token (it has a logits row)",
             PARAMETERS, "self, state, has_new_token, complete_blocks, query_length"),
    Internal(f"{_CB}.requests", "RequestStatus", READ,
             "--kv-backend native: FINISHED / FAILED requests' sampling state is freed at the next step",
             MEMBERS, "PENDING, PREFILLING, DECODING, FINISHED, FAILED"),
    Internal(f"{_CB}.continuous_api.ContinuousBatchingManager", "continuous_batching_config", READ,
             "--kv-backend native: the resolved config; its CUDA graphs or compile (which replay the sampling) "
             "make a request with its own sampling a 400", ASSIGNED,
             "self.continuous_batching_config set by the class"),
    Internal(f"{_CB}.cb_logits_processors.ContinuousBatchingLogitsProcessorList", "logits_processor", READ,
             "--kv-backend native: the worker's processors (those without a per-request version apply to every row)",
             ASSIGNED, "self.logits_processor set by the class"),
    Internal(f"{_CB}.cb_logits_processors.ContinuousBatchingLogitsProcessorList", "supported_keys", READ,
             "--kv-backend native: the per-request keys the worker takes (the ones set neutral)", ASSIGNED,
             "self.supported_keys set by the class"),
    Internal(f"{_CB}.cb_logits_processors", "ContinuousBatchingLogitsProcessor", READ,
             "--kv-backend native: the base of the per-request processors (isinstance)", INTERFACE,
             "3904bf50793b5140"),
    Internal(f"{_CB}.cb_logits_processors.ContinuousBatchingTemperatureLogitsWarper", "__call__", READ,
             "--kv-backend native: temperature 1 leaves a row as it is", SOURCE, "3425f8338a81c3b1"),
    Internal(f"{_CB}.cb_logits_processors.ContinuousBatchingTopKLogitsWarper", "__call__", READ,
             "--kv-backend native: top_k = the vocabulary leaves a row as it is", SOURCE, "9d84bcad8b61098d"),
    Internal(f"{_CB}.cb_logits_processors.ContinuousBatchingTopPLogitsWarper", "__call__", READ,
             "--kv-backend native: top_p 1 leaves a row as it is (but tokens whose probability is 0 in float32)",
             SOURCE, "1d93788e7bb9b8d1"),
    Internal("transformers.cli.serving.utils.CBGenerateManager", "_cb", READ,
             "the ContinuousBatchingManager its init_cb built (--kv-backend native: started() wraps it)", ASSIGNED,
             "self._cb set by the class"),
    # ---- stood in for
    Internal(f"{_CB}.cache", "PagedAttentionCache", IMPLEMENTED,
             "KVPlugPagedCache answers the scheduler's and model runner's calls in its place",
             INTERFACE, "c55c2dca61151f40"),
)


@dataclass(frozen=True)
class TransformersModules:
    """The transformers modules the adapter touches, imported once the version gate passed."""

    version: str
    continuous_api: ModuleType
    cache: ModuleType
    modeling_utils: ModuleType
    model_runner: ModuleType
    scheduler: ModuleType


def parse_version(text: str) -> tuple[int, int, int]:
    """``"5.17.0"`` → ``(5, 17, 0)``; pre-release and local suffixes are ignored (``"5.18.0.dev0"`` → 5.18.0)."""
    numbers: list[int] = []
    for part in text.split("+")[0].split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        numbers.append(int(digits))
        if len(numbers) == 3 or len(digits) != len(part):
            break
    while len(numbers) < 3:
        numbers.append(0)
    return numbers[0], numbers[1], numbers[2]


def is_supported_version(text: str) -> bool:
    return MIN_VERSION <= parse_version(text) < MAX_VERSION_EXCLUSIVE


def check_version(text: str, *, env: dict | None = None) -> None:
    """Raise ``UnsupportedTransformersError`` unless ``text`` is in ``SUPPORTED_RANGE`` (or the check is skipped)."""
    environ = os.environ if env is None else env
    if environ.get(SKIP_CHECK_ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
        return
    if not is_supported_version(text):
        raise UnsupportedTransformersError(
            f"kvplug-transformers supports transformers {SUPPORTED_RANGE}, found transformers {text}. "
            f"Install a supported release ({INSTALL_HINT}), or set {SKIP_CHECK_ENV}=1 to try anyway "
            "(the adapter replaces private continuous-batching internals, so an untested release may break it)."
        )


# ---------------------------------------------------------------------- fingerprints
def fingerprint(entry: Internal) -> str:
    """``entry``'s fingerprint in the installed transformers (``"missing"`` when the name is gone)."""
    return host_internals.fingerprint(entry)


def drifted(entries: tuple[Internal, ...] = INTERNALS) -> list[tuple[Internal, str]]:
    """``(entry, found)`` for every entry whose fingerprint differs from the pinned release's."""
    return host_internals.drifted(entries)


def check_internals(version: str, entries: tuple[Internal, ...] = INTERNALS) -> None:
    """Raise one ``UnsupportedTransformersError`` naming every entry that drifted."""
    changes = drifted(entries)
    if not changes:
        return
    lines = host_internals.drift_lines(changes)
    raise UnsupportedTransformersError(
        f"transformers {version} changed {len(changes)} internal(s) kvplug-transformers relies on "
        f"({changes[0][0].short_name} first); the adapter was checked against transformers {PINNED_VERSION} "
        f"({INSTALL_HINT}):\n" + "\n".join(lines)
        + "\nPorting: read the new source of each, adapt the adapter, then update kvplug_transformers.compat.INTERNALS."
    )


def serving_internal(entry: Internal) -> bool:
    """Whether ``entry`` belongs to transformers' HTTP server (``transformers.cli.serving``)."""
    return entry.owner.startswith(f"{_SERVING}.")


def require_transformers(*, serving: bool = False) -> TransformersModules:
    """Import transformers, check its version and the fingerprint of every internal the adapter touches.

    ``serving``: also the HTTP server's internals (``kvplug serve``); the cache integration alone
    leaves them out, since importing transformers' server needs its optional ``[serving]`` extras."""
    try:
        import transformers
    except ImportError as error:
        raise UnsupportedTransformersError(
            f"kvplug-transformers needs transformers {SUPPORTED_RANGE}, which failed to import ({error}); "
            f"install it with `{INSTALL_HINT}`"
        ) from error
    check_version(transformers.__version__)
    entries = INTERNALS if serving else tuple(entry for entry in INTERNALS if not serving_internal(entry))
    check_internals(transformers.__version__, entries)
    return TransformersModules(
        version=transformers.__version__,
        continuous_api=importlib.import_module(f"{_CB}.continuous_api"),
        cache=importlib.import_module(f"{_CB}.cache"),
        modeling_utils=importlib.import_module("transformers.modeling_utils"),
        model_runner=importlib.import_module(f"{_CB}.model_runner"),
        scheduler=importlib.import_module(f"{_CB}.scheduler"),
    )


def internals_table_markdown(entries: tuple[Internal, ...] = INTERNALS) -> str:
    """``INTERNALS`` as the Markdown table of the adapter README (a test keeps the two equal)."""
    return host_internals.internals_table_markdown(entries, "transformers internal", f"transformers {PINNED_VERSION}")
