"""Installing kvplug into transformers' continuous batching: the nine replaced internals.

Each is an entry of kind ``patched`` in ``compat.INTERNALS`` (the version gate fingerprints it;
the adapter README lists the table). Every replacement carries the original as
``__kvplug_original__`` and calls through to it where it runs transformers' own code.

1. ``continuous_api.PagedAttentionCache``, the class ``ContinuousBatchingManager`` instantiates
   when it builds its batch processor, becomes a factory returning ``KVPlugPagedCache``.
2. ``ContinuousBatchingManager.switch_to_cb_friendly_attn``, which picks the ``paged|...``
   attention function when a manager is created, selects ``paged|kvplug`` instead (and, like the
   original, remembers the model's implementation so ``stop()`` restores it).
3. ``ModelRunner.compute_batch``, which runs one step's forward and sampling, first offers the
   step to the kvplug cache (``KVPlugPagedCache.run_decode_graph``: decode-only steps replayed
   from kvplug's CUDA graphs); every other step, and every step of a non-kvplug cache, runs the
   original. Once a kvplug step is enqueued, ``KVPlugPagedCache.step_launched`` commits it on the
   device from the sampled ids.
4. ``ModelRunner.warmup``, which transformers runs before a manager takes requests, runs the
   original and then captures those graphs (``KVPlugPagedCache.capture_decode_graphs``), so no
   request waits for the capture.
5. ``Scheduler.add_waiting_request``, which takes every new request inside transformers'
   per-request error handling, first lets the kvplug cache refuse a prompt that leaves no room
   in ``max_seq_len`` and cap ``max_new_tokens`` to the room left
   (``KVPlugPagedCache.check_waiting_request``): one bad request fails alone instead of stopping
   the batching worker for every request.
6. ``Scheduler._process_candidates``, the scheduling pass both of transformers' schedulers run:
   when it scheduled nothing while the kvplug cache kept host-tier hits waiting for their copies
   (``KVPlugPagedCache.wait_for_deferred_loads``), it waits for the copies and runs the pass again
   with those requests first; otherwise transformers would take the empty pass for a full cache
   and fail.
7. ``ModelRunner._sample``, which samples a step's logits into its output ids (eager steps and
   kvplug's graph replays alike), lets the kvplug cache sample each row with its own request's
   settings (``KVPlugPagedCache.sample_step``, ``sampler.BatchSampler``) when ``kvplug serve``
   asked for per-request sampling (``TransformersHost.sample_per_request``); otherwise the original.
8. ``ContinuousBatchProcessor.prepare_next_batch``, which the batching thread calls before every
   scheduling pass (about every 0.1 s when idle), first lets the kvplug cache do what waits for
   the batching thread (``KVPlugPagedCache.between_steps``: a requested prefix-cache flush, and
   publishing the KV events of the pass before, issue 27), then runs the original.
9. ``ContinuousBatchingManager.add_request``, which queues a request for the batching thread (called
   by ``kvplug serve``'s HTTP handlers in-process and by the engine process's loop), first starts
   the shared KV store's prefetch of the prompt (``KVPlugPagedCache.prefetch``, issue 30), so the
   store's pages are read off the batching thread while the request waits to be scheduled; then
   the original.

All are module/class attributes looked up at call time, so every entry point — ``generate_batch``,
``init_continuous_batching``, ``continuous_batching_context_manager`` and ``transformers serve
--continuous-batching`` — goes through kvplug once installed. ``uninstall`` puts the originals back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from kvplug_transformers.attention import ATTENTION_NAME, register_attention_function
from kvplug_transformers.compat import ORIGINAL_ATTRIBUTE, TransformersModules, require_transformers


@dataclass
class _Originals:
    modules: TransformersModules
    cache_class: Any
    switch_attention: Callable
    compute_batch: Callable
    warmup: Callable
    add_waiting_request: Callable
    process_candidates: Callable
    prepare_next_batch: Callable
    sample: Callable
    add_request: Callable


_lock = threading.Lock()
_installed: _Originals | None = None


def is_installed() -> bool:
    return _installed is not None


def install_patches(make_cache: Callable[..., Any]) -> TransformersModules:
    """Route transformers' continuous batching to kvplug; ``make_cache`` receives
    ``PagedAttentionCache``'s arguments plus ``group_layers_by_attn_type=`` and returns the cache.
    Installing again only replaces ``make_cache``."""
    global _installed
    with _lock:
        modules = _installed.modules if _installed is not None else require_transformers()
        register_attention_function(modules.modeling_utils)
        manager_class = modules.continuous_api.ContinuousBatchingManager
        runner_class = modules.model_runner.ModelRunner
        processor_class = modules.continuous_api.ContinuousBatchProcessor
        if _installed is None:
            _installed = _Originals(
                modules, modules.continuous_api.PagedAttentionCache, manager_class.switch_to_cb_friendly_attn,
                runner_class.compute_batch, runner_class.warmup, modules.scheduler.Scheduler.add_waiting_request,
                modules.scheduler.Scheduler._process_candidates, processor_class.prepare_next_batch,
                runner_class._sample, manager_class.add_request,
            )
        original_compute_batch, original_warmup = _installed.compute_batch, _installed.warmup
        original_add_waiting = _installed.add_waiting_request
        original_process = _installed.process_candidates
        original_prepare = _installed.prepare_next_batch
        original_sample = _installed.sample
        original_add_request = _installed.add_request

        def kvplug_add_request(manager: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
            # the batch processor (and its cache) exists once the manager started; before, no prefetch
            prefetch = getattr(getattr(getattr(manager, "batch_processor", None), "cache", None), "prefetch", None)
            if prefetch is not None:
                prefetch(input_ids)
            return original_add_request(manager, input_ids, *args, **kwargs)

        def kvplug_sample(runner: Any, scores: Any, output_ids: Any) -> None:
            sample_step = getattr(runner.cache, "sample_step", None)
            if sample_step is None or not sample_step(runner, scores, output_ids):
                original_sample(runner, scores, output_ids)

        def kvplug_compute_batch(runner: Any, model: Any, batch_data: dict) -> None:
            cache = runner.cache
            run_decode_graph = getattr(cache, "run_decode_graph", None)
            if run_decode_graph is None:  # not a kvplug cache
                original_compute_batch(runner, model, batch_data)
                return
            if not run_decode_graph(runner, model, batch_data):
                original_compute_batch(runner, model, batch_data)
            cache.step_launched(runner)

        def kvplug_add_waiting_request(scheduler: Any, state: Any) -> None:
            check = getattr(scheduler.cache, "check_waiting_request", None)
            if check is not None:
                check(state)
            original_add_waiting(scheduler, state)

        def kvplug_process_candidates(scheduler: Any, candidates: list, *args: Any, **kwargs: Any) -> Any:
            result = original_process(scheduler, candidates, *args, **kwargs)
            wait = getattr(scheduler.cache, "wait_for_deferred_loads", None)
            if result[0] or wait is None:
                return result
            deferred = wait()
            if deferred:  # they hold their pages already: first, or a full pool may let nothing run
                # an empty pass scheduled nothing, so running it again is what transformers
                # itself does after offloading requests
                ordered = [state for state in candidates if state.request_id in deferred]
                ordered += [state for state in candidates if state.request_id not in deferred]
                result = original_process(scheduler, ordered, *args, **kwargs)
            return result

        def kvplug_prepare_next_batch(processor: Any) -> bool:
            between_steps = getattr(processor.cache, "between_steps", None)
            if between_steps is not None:
                between_steps(processor.model_runner)
            return original_prepare(processor)

        def kvplug_warmup(runner: Any, model: Any) -> None:
            original_warmup(runner, model)
            capture = getattr(runner.cache, "capture_decode_graphs", None)
            if capture is not None:
                capture(model)

        group_layers = modules.cache.group_layers_by_attn_type

        def kvplug_paged_attention_cache(*args: Any, **kwargs: Any) -> Any:
            return make_cache(*args, group_layers_by_attn_type=group_layers, **kwargs)

        replacements = (
            (modules.continuous_api, "PagedAttentionCache", kvplug_paged_attention_cache, _installed.cache_class),
            (manager_class, "switch_to_cb_friendly_attn", _switch_to_kvplug_attention, _installed.switch_attention),
            (runner_class, "compute_batch", kvplug_compute_batch, original_compute_batch),
            (runner_class, "warmup", kvplug_warmup, original_warmup),
            (modules.scheduler.Scheduler, "add_waiting_request", kvplug_add_waiting_request, original_add_waiting),
            (modules.scheduler.Scheduler, "_process_candidates", kvplug_process_candidates, original_process),
            (runner_class, "_sample", kvplug_sample, original_sample),
            (processor_class, "prepare_next_batch", kvplug_prepare_next_batch, original_prepare),
            (manager_class, "add_request", kvplug_add_request, original_add_request),
        )
        for owner, attribute, replacement, original in replacements:  # compat.INTERNALS, kind "patched"
            setattr(replacement, ORIGINAL_ATTRIBUTE, original)
            setattr(owner, attribute, replacement)
        return modules


def uninstall_patches() -> None:
    """Restore transformers' own cache and attention selection (the ``paged|kvplug`` name stays
    registered so models still set to it fail with kvplug's explanation, not a KeyError)."""
    global _installed
    with _lock:
        if _installed is None:
            return
        modules = _installed.modules
        modules.continuous_api.PagedAttentionCache = _installed.cache_class
        modules.continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn = _installed.switch_attention
        modules.model_runner.ModelRunner.compute_batch = _installed.compute_batch
        modules.model_runner.ModelRunner.warmup = _installed.warmup
        modules.scheduler.Scheduler.add_waiting_request = _installed.add_waiting_request
        modules.scheduler.Scheduler._process_candidates = _installed.process_candidates
        modules.model_runner.ModelRunner._sample = _installed.sample
        modules.continuous_api.ContinuousBatchProcessor.prepare_next_batch = _installed.prepare_next_batch
        modules.continuous_api.ContinuousBatchingManager.add_request = _installed.add_request
        _installed = None


def _switch_to_kvplug_attention(manager: Any, model: Any) -> None:
    """Replacement for ``ContinuousBatchingManager.switch_to_cb_friendly_attn``."""
    current = model.config._attn_implementation
    if current != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
        # keep the first original across repeated switches, as transformers does
        if getattr(manager, "_original_attn_impl", None) is None:
            manager._original_attn_impl = current
