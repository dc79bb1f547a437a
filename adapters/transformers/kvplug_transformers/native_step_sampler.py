"""``NativeStepSampler``: kvplug's sampler on the rows of transformers' own steps (``--kv-backend native``).

On transformers' own cache (kvplug not in the loop) a request that sends sampling fields is
sampled by kvplug's ``BatchSampler``, as on the kvplug cache, so one seed gives the same tokens on
both backends; every other request is sampled by transformers as its worker's generation config
says. transformers' ``ModelRunner._sample`` (replaced by ``native_installation``) hands each step
here: when no request of the server has its own sampling the original runs and nothing else
(the A/B baseline keeps its cost); otherwise the original samples the other rows and the rows of
requests with their own settings are overwritten with kvplug's choice.

The rows of a step are the step's requests that predict a token, in batch order
(``ContinuousBatchingIOs.requests_in_batch``, the current pair's with async batching). Their
logits are raw: the worker's only processors are transformers' per-request temperature / top-k /
top-p, which such a request sets neutral (``NativeRequestSampling``). ``stop`` strings end a
request as on the kvplug cache (``StopStrings.check``, here at the request's next step: the same
one token later); finished, failed and cancelled requests are released at the next step.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from kvplug_transformers.sampler import BatchSampler
from kvplug_transformers.stop_strings import StopStrings


class NativeStepSampler:
    """Samples the rows of requests with their own settings in transformers' own steps.

    Args:
        sampling: the server's ``NativeRequestSampling`` (registered requests; ``take`` hands
            their settings over at their first sampled row).
        decode: token ids to text for ``stop`` strings (``None``: none may have any).
    """

    def __init__(self, sampling: Any, decode: Callable[[list[int]], str] | None) -> None:
        self._sampling = sampling
        self._batch: BatchSampler | None = None  # built at the first row, on the logits' device
        self._states: dict[str, Any] = {}  # request id -> RequestState, of the requests sampled here
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()  # cancel() comes from the handlers' threads
        self._stops = StopStrings(self._stops_of, decode) if decode is not None else None
        from transformers.generation.continuous_batching.requests import RequestStatus

        self._ended = (RequestStatus.FINISHED, RequestStatus.FAILED)  # compat.INTERNALS: RequestStatus

    @property
    def tracked(self) -> int:
        """Requests with sampling state here (for tests: none once all finished)."""
        return len(self._states)

    def cancel(self, request_id: str) -> None:
        """A request cancelled in the worker: its state goes at the next step."""
        with self._lock:
            self._cancelled.add(request_id)

    def sample(self, runner: Any, scores: torch.Tensor, output_ids: torch.Tensor, original: Callable) -> None:
        """transformers' ``ModelRunner._sample(scores, output_ids)`` for one step; ``original`` is its own.

        Args:
            scores: shape ``[1, rows (padded), V]``, float32, device.
            output_ids: ``[1 or 2, max_batch_tokens + 1]``, int32, device; row 0 the ids, row 1 (with
                ``return_logprobs``) their log-probabilities as int32 bits.
        """
        if not self._states and not self._sampling.any_waiting:
            original(runner, scores, output_ids)  # no request has its own sampling: transformers' step as it is
            return
        states = _step_states(runner.inputs_and_outputs)
        self._sweep()
        rows = [row for row, state in enumerate(states)
                if state.request_id in self._states or self._sampling.has(state.request_id)]
        if len(rows) < len(states) or not rows:
            original(runner, scores, output_ids)  # the other rows, as transformers samples them
        if not rows:
            return
        chosen = [states[row] for row in rows]
        for state in chosen:
            self._states.setdefault(state.request_id, state)
            if self._stops is not None:
                self._stops.check(state)
        if self._batch is None:
            self._batch = BatchSampler(self._sampling.take, scores.shape[-1], scores.device,
                                       forget=self._sampling.discard)
        index = torch.tensor(rows, dtype=torch.int64).to(scores.device, non_blocking=True)
        logits = scores[0, : len(rows)] if rows[-1] == len(rows) - 1 else scores[0].index_select(0, index)
        ids, processed = self._batch.sample([state.request_id for state in chosen], self._prompt_of, logits)
        output_ids[0].index_copy_(0, index, ids.to(output_ids.dtype))
        if runner.return_logprobs:
            logprobs = processed.log_softmax(dim=-1).gather(1, ids.unsqueeze(-1)).squeeze(-1)
            output_ids[1].index_copy_(0, index, logprobs.view(dtype=torch.int32))

    def _prompt_of(self, request_id: str) -> list[int]:
        return self._states[request_id].initial_tokens

    def _stops_of(self, request_id: str) -> tuple[str, ...]:
        params = self._batch.params(request_id) if self._batch is not None else None
        return params.stop if params is not None else self._sampling.stops(request_id)

    def _sweep(self) -> None:
        """Release the requests that ended (finished, failed, cancelled) since the last step."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        for request_id, state in list(self._states.items()):
            if state.status in self._ended or request_id in cancelled:
                del self._states[request_id]
                if self._batch is not None:
                    self._batch.release(request_id)
        for request_id in cancelled:
            if request_id not in self._states:
                self._sampling.discard(request_id)  # cancelled before its first row


def _step_states(ios: Any) -> list[Any]:
    """The ``RequestState`` of each logits row of the step being computed, in row order."""
    pairs = getattr(ios, "io_pairs", None)
    host_io = ios if pairs is None else pairs[ios.current_pair].host_io
    return [future.state for future in host_io.requests_in_batch if future.has_new_token]
