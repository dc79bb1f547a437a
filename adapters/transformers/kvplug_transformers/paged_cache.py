"""``KVPlugPagedCache``: what transformers' continuous batching gets instead of ``PagedAttentionCache``.

transformers' scheduler keeps running unchanged; it talks to this object through the methods
``PagedAttentionCache`` offers it, and each maps onto kvplug (``kvplug.backend.KVBackend``):

====================================  ==========================================================
transformers calls                    kvplug does
====================================  ==========================================================
``add_request`` (kvplug's wrapper)    ``prefetch``: the shared KV store's pages of the prompt are
                                      read off the batching thread (``--remote-kv``, issue 30)
``search_prefix_match(id, prompt)``   look the prompt up; on a hit ``admit`` (row, prefix locked)
``allocate_blocks(n, id, have)``      ``admit`` if not yet; promise pages up to ``(have + n) * P``
``extend_read_and_write_indices``     record the request's ``(past, new)`` tokens for this step
attention, first layer of a step      ``allocate`` to the step's lengths, ``prepare`` the batch
attention, every layer                ``forward`` (store K/V at ``out_loc``, attend)
forward + sampler enqueued           commit the step on the device (``StepTracker.commit_step``)
``free_blocks(id)``                   ``finish``: computed prefix into the prefix cache, row freed
before every scheduling pass          ``between_steps``: a requested prefix-cache flush, then the
                                      step's KV events to the publisher (``--kv-events-config``)
====================================  ==========================================================

transformers' block size is kvplug's page size, its block count kvplug's page count; pages the
prefix cache could evict count as free. Step and page bookkeeping live in ``StepTracker``.

Streams: transformers runs the forward on its own compute stream. Once the first step ran
(``attach_runner``), every entry point above works on that stream too, so kvplug's table and
token-pool writes are ordered with the forwards that read them - which is what lets
transformers' async batching (``settings.overlap_schedule``) schedule step N+1 while step N
runs: a row freed by a request that step N still reads is rewritten only after step N.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
from typing import Any

import torch

from kvplug.backend import KVBackend, create_backend
from kvplug.interface import InvalidArgumentError

from kvplug_transformers.decode_graphs import HostDecodeGraphs, graphs_for
from kvplug_transformers.planning import PoolPlan, model_context_len, model_shape, plan_pool
from kvplug_transformers.sampler import BatchSampler
from kvplug_transformers.settings import KVPlugSettings
from kvplug_transformers.step_tracker import StepTracker
from kvplug_transformers.stop_strings import StopStrings

logger = logging.getLogger("kvplug_transformers")


class _NoBlockTables:
    """What transformers' offloading manager reads as ``group_cache_managers[i].block_table``:
    kvplug lends it no block ids, so it never copies KV to its CPU pool (it soft-resets instead,
    and the re-prefill then hits kvplug's prefix cache)."""

    block_table: dict[str, list[int]] = {}


class KVPlugPagedCache:
    """A kvplug-backed stand-in for ``transformers...continuous_batching.PagedAttentionCache``.

    Built by transformers with ``PagedAttentionCache``'s arguments plus the adapter's settings.
    """

    def __init__(
        self,
        config: Any,
        continuous_batching_config: Any,
        device: torch.device | str,
        distributed_helper: Any,
        tp_plan: dict,
        dtype: torch.dtype = torch.float16,
        *,
        settings: KVPlugSettings,
        group_layers_by_attn_type: Any,
        on_stats: Any = None,
        kv_events: Any = None,
        request_sampling: Any = None,
    ) -> None:
        if getattr(distributed_helper, "tp_size", 1) > 1:
            raise InvalidArgumentError("kvplug_transformers does not support tensor parallelism yet (tp_size > 1)")
        _, group_types = group_layers_by_attn_type(config)
        if set(group_types) != {"full_attention"}:
            raise InvalidArgumentError(
                f"kvplug_transformers supports models whose layers are all full attention; this model has "
                f"{sorted(set(group_types))} layers (sliding-window / hybrid models: use the native cache)"
            )
        cb = continuous_batching_config
        self.plan: PoolPlan = plan_pool(
            settings,
            model_shape(config, dtype),
            device,
            context_len=model_context_len(config),
            cb_num_blocks=cb.num_blocks,
            cb_block_size=cb.block_size,
            cb_max_batch_tokens=cb.max_batch_tokens,
            max_memory_percent=cb.max_memory_percent,
        )
        self.backend: KVBackend = create_backend(
            config,
            page_size=self.plan.page_size,
            num_pages=self.plan.num_pages,
            max_running_reqs=self.plan.max_running_reqs,
            max_seq_len=self.plan.max_seq_len,
            prefix_cache=settings.prefix_cache,
            attention=settings.attention,
            device=device,
            dtype=dtype,
            **_with_host_memory(settings),
        )
        self.settings = settings
        self._compute_stream: Any = None  # transformers' compute stream, once a step ran (attach_runner)
        self._disable_unsupported_features(cb)
        logger.info(
            "kvplug KV pool built: %s; prefix cache %s, attention %s",
            self.plan.describe(), settings.prefix_cache, self.backend.attention_name,
        )
        self._init_transformers_attributes(config, dtype, device)
        self.steps = StepTracker(self.backend, on_stats=on_stats, defer_loads=settings.defer_host_loads)
        self.decode_graphs: HostDecodeGraphs | None = graphs_for(self, settings)
        # per-request sampling (kvplug serve's RequestSampling); None: transformers samples as configured
        self.sampler: BatchSampler | None = None
        if request_sampling is not None:
            vocab_size = config.get_text_config().vocab_size if hasattr(config, "get_text_config") else config.vocab_size
            self.sampler = BatchSampler(request_sampling.take, vocab_size, self.backend.device,
                                        forget=request_sampling.discard)
        self.stop_strings: StopStrings | None = None
        if request_sampling is not None and request_sampling.decode is not None:
            self.stop_strings = StopStrings(self._stops_of, request_sampling.decode)
        # issue 27: the server's KVEventCollector (None: no --kv-events-config); flushes asked for by
        # the HTTP routes wait here for the batching thread, the backend's one driver
        self.kv_events = kv_events
        if kv_events is not None:
            kv_events.attach(self.backend.prefix_cache)
        self._flushes: queue.SimpleQueue = queue.SimpleQueue()
        self._warmups: queue.SimpleQueue = queue.SimpleQueue()  # (future, model) of request_warmup

    # ------------------------------------------------------------------ construction helpers
    def _disable_unsupported_features(self, cb: Any) -> None:
        """Turn off what would bypass kvplug: the flash decode fast path (its own block table),
        transformers' own CUDA graphs and torch.compile of the step (they would capture kvplug's
        per-step batch; kvplug captures decode graphs of its own, ``settings.cuda_graphs``) and
        transformers' CPU offload pool. Async batching (step N+1 prepared while N runs) follows
        ``settings.overlap_schedule``: on CUDA by default, whatever transformers' own heuristic
        (which keys on its CUDA graphs) chose."""
        if cb.varlen_compile_config is not None or cb.decode_compile_config is not None:
            logger.warning("kvplug_transformers: turning off torch.compile of the step (not supported with the kvplug cache)")
        cb.use_cuda_graph = (False, False)
        overlap = self.settings.overlap_schedule
        cb.use_async_batching = self.backend.device.type == "cuda" and overlap is not False
        cb.varlen_compile_config = None
        cb.decode_compile_config = None
        cb.max_blocks_per_request = 0
        cb.cpu_offload_space = 0.0

    def _init_transformers_attributes(self, config: Any, dtype: torch.dtype, device: Any) -> None:
        pool, plan = self.backend.pool, self.plan
        self.config = config
        self.dtype = dtype
        self.device = pool.device
        self.num_key_value_heads = pool.local_kv_heads
        self.head_dim = pool.head_dim
        self.block_size = plan.page_size
        self.num_blocks = plan.num_pages
        self.num_pages = plan.num_tokens  # transformers' "pages" are tokens
        self.max_batch_tokens = plan.max_batch_tokens
        self.max_blocks_per_request = 0
        self.num_groups = 1
        self.num_full_attention_groups = 1
        self.num_sliding_attention_groups = 0
        self.sliding_windows = {layer: 1 for layer in range(pool.num_layers)}
        self.layer_index_to_group_indices = {layer: (0, layer) for layer in range(pool.num_layers)}
        self.allow_block_sharing = True
        self.use_prefix_sharing = True
        self.read_trash_index = self.write_trash_index = self.sentinel_index = pool.dummy_location
        flat = ((pool.num_pages + 1) * pool.page_size, pool.local_kv_heads, pool.head_dim)
        self.key_cache = [pool.k_cache(layer).view(flat) for layer in range(pool.num_layers)]
        self.value_cache = [pool.v_cache(layer).view(flat) for layer in range(pool.num_layers)]
        self.group_cache_managers = [_NoBlockTables()]

    # ------------------------------------------------------------------ scheduler-facing
    @property
    def _total_prefix_length(self) -> int:
        """transformers' own hit counter (tokens matched at admission)."""
        return self.backend.stats().cache_hit_tokens

    def get_num_free_blocks(self) -> int:
        """Pages not yet promised to a request: free or evictable, minus outstanding reservations."""
        return max(self.steps.unpromised_pages(), 0)

    def blocks_needed(self, num_requested_blocks: int, allocated_blocks: int) -> int:
        return num_requested_blocks

    def will_allocation_be_successful(self, num_requested_blocks: int, allocated_blocks: int) -> bool:
        return num_requested_blocks <= self.get_num_free_blocks()

    def blocks_in_use(self, request_id: str) -> int:
        tracked = self.steps.get(request_id)
        return 0 if tracked is None else -(-tracked.capacity // self.block_size)

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """The cached prefix of a waiting request, in tokens: a multiple of the page size, at
        most ``len(prompt_ids) - 1``. A hit admits the request (row taken, prefix locked)."""
        with self._ordered():
            return self.steps.match(request_id, prompt_ids)

    def allocate_blocks(self, n_blocks: int, request_id: str, allocated_blocks: int) -> int | None:
        """Promise the request ``allocated_blocks + n_blocks`` pages in all; ``None`` (nothing
        changed) when the pool cannot supply them even after evicting cached prefixes, or when
        no page-table row is free for a request not admitted yet."""
        target = min((allocated_blocks + n_blocks) * self.block_size, self.backend.max_seq_len)
        if self.steps.get(request_id) is not None:
            # a running request's promise is host bookkeeping only: no stream switch on this
            # per-request, per-page-boundary call
            return n_blocks if self.steps.reserve(request_id, target) else None
        with self._ordered():  # admission writes the request's table row
            return n_blocks if self.steps.reserve(request_id, target) else None

    def wait_for_deferred_loads(self) -> set[str]:
        """A scheduling pass found nothing to run: wait for the prefixes still copying from the
        host tier (``StepTracker.wait_for_deferred_loads``); returns the requests kept waiting for
        them (none: the pass stands)."""
        with self._ordered():
            return self.steps.wait_for_deferred_loads()

    def free_blocks(self, request_id: str) -> None:
        with self._ordered():
            if self.sampler is not None and not self.steps.is_requeued(request_id):
                self.sampler.release(request_id)  # a soft reset keeps its seed's stream and its counts
            self.steps.finish(request_id)

    def free_all_requests(self) -> None:
        with self._ordered():
            if self.sampler is not None:
                self.sampler.release_all()
            self.steps.finish_all()

    # ------------------------------------------------------------------ between steps (issue 27)
    def request_flush(self) -> concurrent.futures.Future:
        """Empty the prefix cache at the batching thread's next scheduling pass (any thread may ask);
        the future's result is the pages freed (``KVBackend.reset_prefix_cache``: running requests
        keep their prefixes until they finish)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._flushes.put(future)
        return future

    def request_warmup(self, model: Any) -> concurrent.futures.Future:
        """Capture the decode graphs (when on) for ``model`` at the batching thread's next
        scheduling pass, before it schedules anything (any thread may ask): ``kvplug serve``
        waits for the future before ``/health`` says ready. Its result: whether graphs are on."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._warmups.put((future, model))
        return future

    def between_steps(self, runner: Any = None) -> None:
        """Before every scheduling pass of the batching thread (the patched
        ``ContinuousBatchProcessor.prepare_next_batch``, about every 0.1 s when idle; ``runner``
        its ``ModelRunner``): run the warm-ups asked for (``request_warmup``) and the flushes, then
        publish the KV events of the pass before as one batch."""
        while not self._warmups.empty():
            future, model = self._warmups.get_nowait()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if runner is not None:
                    self.attach_runner(runner)  # captured on the stream the steps replay on
                with self._ordered():
                    self.capture_decode_graphs(model)
            except Exception as error:  # the server's start fails with it
                future.set_exception(error)
            else:
                future.set_result(self.decode_graphs is not None)
        while not self._flushes.empty():
            future = self._flushes.get_nowait()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with self._ordered():
                    freed = self.steps.reset_prefix_cache()
            except Exception as error:  # e.g. a host tier, which cannot be handed over: the caller hears it
                future.set_exception(error)
            else:
                future.set_result(freed)
        if self.kv_events is not None:
            self.kv_events.end_step()

    def mark_shareable_blocks_as_complete(self, state: Any, num_complete_blocks: int) -> None:
        """transformers' update of a request the step covered (right after it appended the
        request's token): its blocks need nothing, kvplug committed the step when it was launched
        (``step_launched``); a request whose output now holds one of its stop strings is ended."""
        if self.stop_strings is not None:
            self.stop_strings.check(state)

    def _stops_of(self, request_id: str) -> tuple[str, ...]:
        params = self.sampler.params(request_id)
        return () if params is None else params.stop

    def extend_read_and_write_indices(
        self, request_id: str, past_length: int, query_length: int, read_index: Any, write_index: list
    ) -> None:
        """Record the request for this step. No index lists are built: ``paged|kvplug`` reads
        kvplug's page table, so transformers' per-token read/write indices stay empty."""
        self.steps.add_to_step(write_index, request_id, past_length, query_length)

    def get_seqlens_k(self, past_length: int, query_length: int) -> dict[str, int]:
        return {"full_attention": past_length + query_length}

    def fill_block_table(self, *args: Any) -> None:
        raise InvalidArgumentError("the flash decode fast path is disabled with kvplug (max_blocks_per_request=0)")

    def update(self, *args: Any, **kwargs: Any):
        raise InvalidArgumentError(
            "the kvplug cache serves attention through attn_implementation='paged|kvplug' only; "
            "got a call from another paged attention implementation"
        )

    def compute_max_num_forks(self, source_request_id: str) -> int:
        """No in-place fork: parallel samples are re-admitted as new requests and hit the prefix cache."""
        return 0

    def fork_request(self, source_request_id: str, destination_request_ids: list[str]):
        raise InvalidArgumentError("kvplug does not fork requests in place (compute_max_num_forks is 0)")

    # ------------------------------------------------------------------ attention-facing
    def attention_forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        """Store K/V and attend for one layer of the current step.

        Args:
            q: shape ``[num_tokens, num_qo_heads, head_dim]``, pool dtype, device.
            k, v: shape ``[num_tokens, num_kv_heads, head_dim]``, pool dtype, device.
            scaling: the model's softmax scale (``None``: ``head_dim ** -0.5``).

        Returns:
            shape ``[num_tokens, num_qo_heads * head_dim]``, pool dtype, device.
        """
        batch = self.steps.current_batch()
        attention = self.backend.attention
        backend_scale = getattr(attention, "scale", None) or self.head_dim**-0.5
        if scaling is not None and abs(scaling - backend_scale) > 1e-12 * backend_scale:
            q = q * (scaling / backend_scale)  # the backend applies its own scale; fold in the ratio
        return self.backend.forward(q, k, v, layer_id, batch)

    def prefetch(self, input_ids: Any) -> bool:
        """A request was queued (``ContinuousBatchingManager.add_request``, on the caller's thread):
        start reading the shared KV store's pages of its prompt (``KVBackend.prefetch``, issue 30).
        A prompt kvplug cannot take is left to transformers' own checks (nothing started)."""
        try:
            return self.backend.prefetch(input_ids)
        except InvalidArgumentError:
            return False

    def check_waiting_request(self, state: Any) -> None:
        """A new request (transformers' ``RequestState``), before it waits for scheduling: refuse
        a prompt that leaves no room for one generated token in ``max_seq_len`` (the request
        fails alone, with this error) and cap its new tokens to the room left, so generation
        stops at the limit (finish reason ``length``) instead of outgrowing the page-table row."""
        limit, prompt_len = self.backend.max_seq_len, len(state.initial_tokens)
        if prompt_len >= limit:
            raise InvalidArgumentError(
                f"request {state.request_id} has {prompt_len} prompt tokens; kvplug's max_seq_len is {limit} "
                f"tokens (prompt + completion), so a prompt may have at most {limit - 1}"
            )
        room = limit - prompt_len
        if state._new_tokens_limit > room:
            state._new_tokens_limit = room
            state.max_new_tokens = room
        self.steps.remember(state)

    def capture_decode_graphs(self, model: Any) -> None:
        """Capture the decode graphs now (transformers' warm-up), when graphs are on; otherwise
        the first decode-only step captures them."""
        if self.decode_graphs is not None:
            self.decode_graphs.ensure_captured(model)

    def run_decode_graph(self, runner: Any, model: Any, batch_data: dict) -> bool:
        """transformers' step from kvplug's CUDA graphs when it is a decode-only step that fits
        (``HostDecodeGraphs.run_step``); ``False``: run it eagerly."""
        self.attach_runner(runner)
        graphs = self.decode_graphs
        return graphs is not None and graphs.run_step(runner, model, batch_data)

    def sample_step(self, runner: Any, scores: torch.Tensor, output_ids: torch.Tensor) -> bool:
        """Sample the step with each request's own settings (``BatchSampler``) in place of
        transformers' ``ModelRunner._sample``; ``False`` (nothing done) without per-request sampling.

        Args:
            scores: shape ``[1, rows, V]``, float32, device: the step's logits (raw: the worker runs no
                logits processor), the sampling requests' rows first, in step order.
            output_ids: transformers' static output, ``[1 or 2, max_batch_tokens + 1]``, int32, device;
                row 0 gets the ids, row 1 (with ``return_logprobs``) their log-probabilities as int32 bits.
        """
        if self.sampler is None:
            return False
        if runner.logit_processor.do_processing:
            # the scores are not raw: transformers' processors would be applied twice
            raise InvalidArgumentError(
                "per-request sampling needs a worker started without logits processors (its generation config "
                "from RequestSampling.config(model)); this one runs transformers' processors on every request"
            )
        request_ids = self.steps.sampling_request_ids()
        count = len(request_ids)
        if scores.shape[1] < count:
            raise InvalidArgumentError(
                f"the step has {count} sampling requests but transformers computed {scores.shape[1]} logits rows"
            )
        ids, processed = self.sampler.sample(request_ids, self.steps.prompt_ids, scores[0, :count])
        output_ids[0, :count].copy_(ids)
        if runner.return_logprobs:
            logprobs = processed.log_softmax(dim=-1).gather(1, ids.unsqueeze(-1)).squeeze(-1)
            output_ids[1, :count].copy_(logprobs.view(dtype=torch.int32))
        return True

    def step_launched(self, runner: Any) -> None:
        """transformers' step (forward, logits processors, sampler) is enqueued: commit it on
        the device from the sampled ids in ``runner``'s output buffer (``StepTracker.commit_step``).
        Called by the patched ``ModelRunner.compute_batch`` after every step."""
        output_ids = runner.inputs_and_outputs.output_ids  # [1 or 2, max_batch_tokens + 1], int32
        with self._ordered():
            self.steps.commit_step(output_ids[0])

    def attach_runner(self, runner: Any) -> None:
        """Order kvplug's device work on ``runner``'s compute stream from now on (see the module
        docstring). The first step's scheduling ran on the default stream, which staging waits for."""
        if self._compute_stream is None:
            self._compute_stream = runner.inputs_and_outputs.compute_stream

    def _ordered(self) -> Any:
        """A context running kvplug's device work on transformers' compute stream (when known)."""
        stream = self._compute_stream
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def stats(self):
        """The backend's ``BackendStats`` now."""
        return self.backend.stats()


def _with_host_memory(settings: KVPlugSettings) -> dict[str, Any]:
    """``settings.backend_options`` plus the prefix cache's ``host_memory`` option when a tier is set."""
    options = dict(settings.backend_options)
    if settings.host_memory is not None:
        cache_options = dict(options.get("prefix_cache_options") or {})
        cache_options["host_memory"] = settings.host_memory
        if settings.remote_kv is not None:  # issue 30
            cache_options["remote_kv"] = settings.remote_kv
            cache_options["remote_kv_model"] = settings.remote_kv_model
        options["prefix_cache_options"] = cache_options
    return options
