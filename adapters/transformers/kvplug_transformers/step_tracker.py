"""``StepTracker``: transformers' request ids and steps, mapped onto kvplug requests and batches.

A continuous-batching step, as transformers drives it (one background thread):

1. scheduling: ``match`` (prefix lookup, admission on a hit) and ``reserve`` (capacity, admission
   on a miss) per candidate request;
2. batch preparation: ``add_to_step`` per scheduled request, with the step's ``(past, new)``;
3. forward: the first attention call builds the step's ``AttentionBatch`` (``current_batch``),
   allocating kvplug pages for exactly the tokens the step computes - or, when kvplug replays
   the step from a CUDA graph, ``stage`` builds it before the replay. A decode-only step is a
   ``KVBackend.begin_decode`` step (pages, batch and input ids in one staging launch);
4. right after the forward and the sampler are enqueued: ``commit_step`` with the sampled ids as
   a device tensor (the step's K/V count as cached, the ids become the next tokens in the token
   pool, prefill chunks go into the prefix cache) - no host sync, so with transformers' async
   batching the next step is scheduled and staged while this one runs;
5. transformers' update (later, once it has the ids on the host): maybe ``finish``.

transformers reserves blocks *ahead* of the tokens it knows, kvplug allocates pages only for known
tokens. ``reserve`` therefore records a promise: the pages a request may still claim. The
invariant ``sum(promised pages) <= free + evictable pages`` makes every step's allocation succeed;
an admission whose prefix lock would break it is declined (the request keeps waiting). A request
is admitted to kvplug (row, lock, statistics) only once transformers schedules it or a prefix hit
makes it active, so requests waiting for memory hold nothing.

With ``defer_loads`` (``KVPlugSettings.defer_host_loads``) a prefix hit in the host-memory tier is
copied back while other requests run: ``match`` admits
the request (the load starts) but reports no hit while its pages are still copying
(``KVBackend.loads_ready``), so transformers keeps it waiting and ``reserve`` refuses it; a later
``match``, once the copy is done, reports the hit and the request joins a step. Only when nothing
else could be scheduled does the scheduler wait for the copies (``wait_for_deferred_loads``,
through the patched ``Scheduler._process_candidates``, which then schedules those requests first:
they hold their pages already, and in a full pool nothing else may be able to run). A load then
costs its running requests nothing, where joining at once makes the step it joins wait for the
copy (on the device: ``KVBackend.prepare`` orders it; the default).

Because a step is committed when it is launched, kvplug's lengths can run ahead of transformers'
view by the step in flight: with async batching a request transformers finishes after seeing step
N's token was already part of step N+1. ``finish`` then caches K/V up to the token step N sampled
(step N+1 computed them); the id step N+1 sampled lies past the cached length and is dropped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch

from kvplug.backend import DecodeStep, KVBackend, PrefixLookup
from kvplug.interface import AttentionBatch, ForwardPhase, InvalidArgumentError, OutOfMemoryError
from kvplug.memory.request import Request


class _Waiting(NamedTuple):
    """A request ``match`` did not admit: its prompt's lookup, and whether it found nothing."""

    lookup: PrefixLookup
    matched_nothing: bool


@dataclass(eq=False)
class Tracked:
    """One transformers request and its kvplug request.

    Attributes:
        request_id: transformers' id.
        request: the kvplug request (row, lengths, locked prefix).
        capacity: tokens transformers believes the request holds (its blocks x page size).
        promised: pages of ``capacity`` kvplug has not allocated yet (while ``loading``: of the
            rest of its prompt).
        forward_done: its last forward ran but produced no token to append, so those K/V may
            still be cached at finish.
        loading: admitted, but its prefix is still copying from the host tier: transformers
            keeps it waiting (``match`` reported no hit).
    """

    request_id: str
    request: Request
    capacity: int
    promised: int = 0
    forward_done: bool = False
    loading: bool = False


class StepTracker:
    """Maps transformers' per-request calls onto ``KVBackend`` (see module docstring)."""

    def __init__(self, backend: KVBackend, on_stats: Callable[[Any], None] | None = None, *,
                 defer_loads: bool = False) -> None:
        self.backend = backend
        self.defer_loads = defer_loads
        self.page_size = backend.page_size
        self._tracked: dict[str, Tracked] = {}
        self._promised_total = 0
        self._step_marker: object | None = None
        self._step: list[tuple[Tracked, int, int]] = []
        self._batch: AttentionBatch | None = None
        self._decode_step: DecodeStep | None = None  # the step's, when it is decode-only
        self._available: int | None = None  # available_pages, until the backend changes
        self._step_committed = False
        self._waiting_prompts: dict[str, _Waiting] = {}
        self._states: dict[str, Any] = {}  # request id -> transformers' RequestState (remember)
        self._declined: set[str] = set()
        self._on_stats = on_stats
        self.deferred_admissions = 0  # hits kept waiting while their prefix copied from host memory

    def get(self, request_id: str) -> Tracked | None:
        return self._tracked.get(request_id)

    # ------------------------------------------------------------------ page accounting
    def available_pages(self) -> int:
        """Pages an allocation could obtain now: free plus evictable from the prefix cache.

        transformers asks for free blocks once per candidate request while it schedules a step
        (256 times a step at batch 256), and the prefix cache's size is a walk of its counters:
        the figure is kept until this tracker changes the backend (``_backend_changed``), since
        during continuous batching every change goes through it."""
        available = self._available
        if available is None:
            available = self._available = self.backend.available_pages()  # issue 32 seam: through the cache guard
        return available

    def _backend_changed(self) -> None:
        """Pages were taken, freed, cached or locked: ``available_pages`` is computed again."""
        self._available = None

    def unpromised_pages(self) -> int:
        """Pages transformers may still reserve: available minus promises already made."""
        return self.available_pages() - self._promised_total

    def _set_promise(self, tracked: Tracked, pages: int) -> None:
        self._promised_total += pages - tracked.promised
        tracked.promised = pages

    def _pages_short_of(self, tracked: Tracked, capacity: int) -> int:
        return max(-(-capacity // self.page_size) - tracked.request.allocated_len // self.page_size, 0)

    # ------------------------------------------------------------------ scheduling
    def match(self, request_id: str, prompt_ids: list[int]) -> int:
        """A waiting request's cached prefix, in tokens. The prompt is matched once
        (``KVBackend.lookup``, whose result the admission takes): a hit admits the request at
        once (row taken, prefix locked: transformers counts matched blocks as the request's); a
        miss only remembers the lookup for ``reserve``, which admits without matching again. A
        hit is declined (0) when no row is free or its lock would leave promised pages
        uncovered. A hit whose prefix is still copying from
        the host tier reports 0 until the copy is done (the request is admitted and keeps waiting
        meanwhile)."""
        self._declined.discard(request_id)
        self._waiting_prompts.pop(request_id, None)
        tracked = self._tracked.get(request_id)
        if tracked is not None:
            if not tracked.loading:
                # transformers sent a running request back to waiting (it recomputes what it
                # lost): its kvplug request ends, its computed prefix cached, and it starts over
                self._release(tracked)
            elif not self.backend.loads_ready(tracked.request):
                return 0
            else:
                tracked.loading = False
                return tracked.request.matched_len
        if len(prompt_ids) > self.backend.max_seq_len:
            raise InvalidArgumentError(
                f"request {request_id} has {len(prompt_ids)} prompt tokens; the kvplug cache was built with "
                f"max_seq_len={self.backend.max_seq_len}"
            )
        lookup = self.backend.lookup(prompt_ids)
        if lookup.cached_len == 0:  # nothing cached: reserve admits it without a second lookup
            self._waiting_prompts[request_id] = _Waiting(lookup, matched_nothing=True)
            return 0
        tracked = self._admit(request_id, lookup)
        if tracked is None:
            self._declined.add(request_id)  # no free row: transformers keeps it waiting
            return 0
        if self.unpromised_pages() < 0:
            self._release(tracked)  # its lock made cached pages unevictable that promises count on
            self._declined.add(request_id)  # transformers will now treat it as unmatched: keep it waiting
            return 0
        if self.defer_loads and not self.backend.loads_ready(tracked.request) and self._promise_prompt(tracked):
            tracked.loading = True  # reserve refuses it until a later match finds the copy done
            self.deferred_admissions += 1
            return 0
        return tracked.request.matched_len

    def _promise_prompt(self, tracked: Tracked) -> bool:
        """Promise the pages of the rest of ``tracked``'s prompt, so the pages it holds while it
        waits for its copy never leave it unable to run; ``False`` (nothing changed) when the pool
        cannot: the request then joins at once and its first forward waits for the copy on the
        device, as if it had loaded at admission."""
        pages = self._pages_short_of(tracked, tracked.request.prompt_len)
        if pages - tracked.promised > self.unpromised_pages():
            return False
        self._set_promise(tracked, pages)
        return True

    def wait_for_deferred_loads(self) -> set[str]:
        """Block until every admitted request's prefix has arrived; returns the requests that were
        kept waiting for one (their next ``match`` reports the hit). For a scheduling pass that
        found nothing else to run."""
        deferred = {tracked.request_id for tracked in self._tracked.values() if tracked.loading}
        if deferred:
            self.backend.allocator.wait_for_loads()
        return deferred

    def reserve(self, request_id: str, capacity: int) -> bool:
        """Promise the request pages up to ``capacity`` tokens, admitting it first if ``match``
        missed; ``False`` (nothing changed) when the pool cannot cover every promise or no row
        is free."""
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.loading:
            return False  # transformers sees a waiting request whose match missed: not yet
        if tracked is None:
            waiting = self._waiting_prompts.get(request_id)
            if waiting is None or request_id in self._declined:
                return False
            if -(-capacity // self.page_size) > self.unpromised_pages():
                return False
            tracked = self._admit(request_id, waiting.lookup, match=not waiting.matched_nothing)
            if tracked is None:
                return False
            del self._waiting_prompts[request_id]
        extra = self._pages_short_of(tracked, capacity) - tracked.promised
        if extra > self.unpromised_pages():
            return False
        self._set_promise(tracked, tracked.promised + max(extra, 0))
        tracked.capacity = max(tracked.capacity, capacity)
        return True

    def _admit(self, request_id: str, lookup: PrefixLookup, *, match: bool = True) -> Tracked | None:
        try:
            request = self.backend.admit(lookup, match=match)
        except OutOfMemoryError:
            return None  # every row runs a request: transformers keeps this one waiting
        finally:
            self._backend_changed()
        tracked = Tracked(request_id, request, capacity=request.matched_len)
        self._tracked[request_id] = tracked
        return tracked

    # ------------------------------------------------------------------ the step
    def add_to_step(self, marker: object, request_id: str, past: int, new: int) -> None:
        """Add a request to the step being prepared. ``marker`` is an object transformers creates
        afresh for every step (its write-index list), so a new marker starts a new step."""
        if marker is not self._step_marker:
            self._step_marker, self._step, self._batch, self._decode_step = marker, [], None, None
            self._step_committed = False
        tracked = self._tracked.get(request_id)
        if tracked is None:
            raise InvalidArgumentError(f"request {request_id} was scheduled without being admitted to kvplug")
        request = tracked.request
        if past != request.cached_len or past + new > min(request.num_tokens, tracked.capacity):
            raise InvalidArgumentError(
                f"request {request_id}: transformers computes tokens {past}..{past + new - 1} but kvplug holds "
                f"K/V for {request.cached_len} of its {request.num_tokens} known tokens, "
                f"capacity {tracked.capacity}"
            )
        self._step.append((tracked, past, new))

    def current_batch(self) -> AttentionBatch:
        """The step's ``AttentionBatch``, built on the first attention call of the step (unless
        ``stage`` built it before)."""
        if self._batch is None:
            self.stage()
        return self._batch

    def is_decode_only(self) -> bool:
        """Whether the step being prepared computes one token per request, each its request's
        only known token past the cached ones (what ``KVBackend.begin_decode`` stages)."""
        if not self._step or any(new != 1 for _, _, new in self._step):
            return False
        states = self.backend.allocator.states
        rows = states.rows_of([tracked.request for tracked, _, _ in self._step])
        return not np.count_nonzero(states.num_tokens[rows] - states.cached_len[rows] - 1)

    def stage(self) -> DecodeStep | None:
        """Build the step's batch now: allocate its pages and plan it. Returns the
        ``DecodeStep`` when the step is decode-only (staged padded into a CUDA graph's buffers
        when the backend has one that fits), else ``None``."""
        if self._batch is not None:
            return self._decode_step
        if not self._step:
            raise InvalidArgumentError("paged|kvplug attention was called with no scheduled requests")
        device = self.backend.device
        if device.type == "cuda":
            # scheduling wrote the tables on the default stream; transformers runs the forward on
            # its own compute stream, which does not wait for the default one by itself
            torch.cuda.current_stream(device).wait_stream(torch.cuda.default_stream(device))
        requests = [tracked.request for tracked, _, _ in self._step]
        self._backend_changed()
        # covered by the step's promises, so this never has to fail
        if self.is_decode_only():
            self._decode_step = self.backend.begin_decode(requests)
            self._batch = self._decode_step.batch
        else:
            self.backend.allocate(requests, [past + new for _, past, new in self._step])
            phase = ForwardPhase.DECODE if all(new == 1 for _, _, new in self._step) else ForwardPhase.PREFILL
            self._batch = self.backend.prepare(requests, phase)
        for tracked, _, _ in self._step:
            self._set_promise(tracked, self._pages_short_of(tracked, tracked.capacity))
        return self._decode_step

    @contextlib.contextmanager
    def forward_over(self, step: DecodeStep) -> Iterator[None]:
        """Attention calls inside read ``step.batch`` (a CUDA-graph capture's dummy step)."""
        saved = self._batch
        self._batch = step.batch
        try:
            yield
        finally:
            self._batch = saved

    def sampling_request_ids(self) -> list[str]:
        """The step's requests that sample a token, in step order: the rows of the step's logits
        (a request whose step covers all its known tokens; a prefill chunk short of that samples
        nothing, as transformers' ``has_new_token``)."""
        return [tracked.request_id for tracked, past, new in self._step if past + new >= tracked.request.num_tokens]

    def prompt_ids(self, request_id: str) -> list[int]:
        """A request's prompt ids as transformers holds them (``RequestState.initial_tokens``)."""
        state = self._states.get(request_id)
        return [] if state is None else list(state.initial_tokens)

    def is_requeued(self, request_id: str) -> bool:
        """Whether transformers is ending the request only to queue it again (its offloading's
        soft reset: status ``PENDING`` when it frees the blocks) rather than finishing it."""
        state = self._states.get(request_id)
        return state is not None and getattr(state.status, "name", None) == "PENDING"

    # ------------------------------------------------------------------ after the forward
    def commit_step(self, sampled_ids: torch.Tensor) -> None:
        """The step's forward and sampler are enqueued: commit the step now, on the device.

        Its K/V count as cached; each request whose step covered all its known tokens gets the
        id sampled for it as its next token (a decode-only step: ``DecodeStep.commit``; else
        ``append_tokens``), a prefill chunk moves its computed prefix into the prefix cache,
        and a finished prompt is shared at once. The ids are not read on the host: the writes
        are ordered after the sampler on the stream, so the next step can be staged before the
        host has seen them (transformers' async batching prepares step N+1 while N runs).

        Args:
            sampled_ids: shape ``[>= sampling requests]``, int32, device (transformers'
                ``output_ids[0]``): the ids sampled for the requests of the step that sample, in
                step order. Copied before use (transformers reuses the buffer).
        """
        if self._batch is None or self._step_committed:
            raise InvalidArgumentError("no staged, uncommitted kvplug step to commit (was the forward run?)")
        self._step_committed = True
        self._backend_changed()
        step = self._decode_step
        if step is not None:
            step.commit(sampled_ids[: step.num_live].clone())
            self._report()
            return
        limit = self.backend.max_seq_len
        appended: list[Tracked] = []
        positions: list[int] = []  # each appended request's index among the sampling ones
        shared: list[Tracked] = []
        sampling = 0
        for tracked, past, new in self._step:
            num_tokens = tracked.request.num_tokens
            if past + new < num_tokens:
                shared.append(tracked)  # a prefill chunk: K/V written, no token sampled
                continue
            if num_tokens < limit:
                appended.append(tracked)
                positions.append(sampling)
                if new > 1:
                    shared.append(tracked)  # a prompt finished: share it with waiting requests now
            else:
                tracked.forward_done = True  # no cell left for a sampled token: finish caches its K/V
            sampling += 1
        if appended:
            if positions[-1] == len(positions) - 1:
                ids = sampled_ids[: len(positions)].clone()
            else:
                ids = sampled_ids[torch.tensor(positions, device=sampled_ids.device)]
            self.backend.append_tokens([tracked.request for tracked in appended], ids)
        for tracked in shared:
            self.backend.cache_unfinished(tracked.request)
        self._report()

    # ------------------------------------------------------------------ ending requests
    def remember(self, state: Any) -> None:
        """transformers' ``RequestState`` of a request about to wait: at finish its host-side ids
        (prompt and generated tokens) tell kvplug which sampled ids to cache."""
        self._states[state.request_id] = state

    def finish(self, request_id: str) -> None:
        self._waiting_prompts.pop(request_id, None)
        self._declined.discard(request_id)
        tracked = self._tracked.get(request_id)
        if tracked is not None:
            self._release(tracked)  # reads the request's state: forgotten only after
            self._report()
        self._states.pop(request_id, None)

    def finish_all(self) -> None:
        self._waiting_prompts.clear()
        self._declined.clear()
        for tracked in list(self._tracked.values()):
            self._release(tracked)
        self._states.clear()
        self._step_marker, self._step, self._batch, self._decode_step = None, [], None, None
        self._step_committed = False
        self._report()

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache (``KVBackend.reset_prefix_cache``); the pages freed."""
        try:
            return self.backend.reset_prefix_cache()
        finally:
            self._backend_changed()
            self._report()

    def _release(self, tracked: Tracked) -> None:
        self._set_promise(tracked, 0)
        del self._tracked[tracked.request_id]
        self._backend_changed()
        request = tracked.request
        state = self._states.get(tracked.request_id)
        if state is not None and request.num_tokens > request.known_len:
            try:  # the ids transformers sampled, as it saw them on the host
                self.backend.record_tokens(request, state.initial_tokens + state.generated_tokens)
            except InvalidArgumentError:
                pass  # its prompt was rewritten (a soft reset): cache only what kvplug knows
        self.backend.finish(request, computed=tracked.forward_done)

    def _report(self) -> None:
        if self._on_stats is not None:
            self._on_stats(self.backend.stats())
