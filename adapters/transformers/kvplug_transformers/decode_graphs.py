"""CUDA-graph decode for transformers' continuous batching: decode-only steps replayed from graphs
kvplug captures (``KVBackend.decode_graphs``), everything else eager.

transformers' ``ModelRunner.compute_batch`` runs one step: the model's forward, its logits
processors, sampling into the step's static ``output_ids``. When kvplug is installed it first
asks ``HostDecodeGraphs.run_step``: a decode-only step (one token per request, each request's
only known token past its cached ones) that fits a captured batch size is staged by
``StepTracker.stage`` padded into that size's buffers (``KVBackend.begin_decode``; the dummy
request fills the unused slots), the captured forward replays, and the logits of the live rows
go through transformers' own logits processors and sampler (``runner.logit_processor``,
``runner._sample``, which kvplug's per-request sampler replaces under ``kvplug serve``): sampling
runs eagerly after the replay, on the graph's logits output, exactly as after an eager forward.
Prefill and mixed steps, and decode steps larger than the largest captured size, return
``False`` and run eagerly as before.

The graphs are captured in transformers' warm-up (before the manager takes requests), under
``kvplug serve`` on the batching thread before ``/health`` says ready (``worker_warmup``), or else
at the first decode-only step, at 1, 2, 4, 8, then steps of 8 up to ``cuda_graph_max_bs`` (or
``cuda_graph_batch_sizes``). The captured
function is the model's forward over a ``DecodeStep``: ``input_ids`` and ``position_ids`` are the
step's staged tensors, the attention mask mapping is given (so transformers builds none) and
every ``paged|kvplug`` attention call reads the step's batch. Capture logs its time and the
device memory it took and shows a progress bar.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch

from kvplug.interface import InvalidArgumentError, KVPlugError

if TYPE_CHECKING:
    from kvplug.backend import DecodeStep
    from kvplug_transformers.paged_cache import KVPlugPagedCache

logger = logging.getLogger("kvplug_transformers")


class HostDecodeGraphs:
    """The decode graphs of one ``KVPlugPagedCache`` (see the module docstring).

    Args:
        cache: the kvplug cache transformers built.
        max_batch_size: largest size captured (``<= max_running_reqs``).
        batch_sizes: the sizes captured, or ``None`` for the default ladder.
        torch_compile: capture ``torch.compile(model, dynamic=True)`` instead of the eager model
            (kvplug's attention function stays eager inside it: ``attention.kvplug_paged_attention``).
    """

    def __init__(
        self, cache: "KVPlugPagedCache", *, max_batch_size: int, batch_sizes: tuple[int, ...] | None,
        torch_compile: bool = False,
    ) -> None:
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.batch_sizes = batch_sizes
        self.torch_compile = torch_compile
        self.graphs = None
        self._model: Any = None
        self.replayed_steps = 0

    def run_step(self, runner: Any, model: Any, batch_data: dict) -> bool:
        """Run transformers' step from a graph when it is a decode-only step that fits; returns
        whether it did. ``False``: run the step eagerly - a decode-only step too big for every
        graph is already staged then, and the eager forward reads that batch."""
        steps = self.cache.steps
        if not steps.is_decode_only():
            return False
        stream = runner.inputs_and_outputs.compute_stream
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            self.ensure_captured(model)
            step = steps.stage()
            if step is None or step.graph_size is None:
                return False  # too big for every graph: the eager forward reads the staged batch
            logits = self.graphs.run(step)  # [live, vocab]
            self._process_and_sample(runner, logits, step.input_ids[: step.num_live], batch_data)
        self.replayed_steps += 1
        return True

    # ------------------------------------------------------------------ capture
    def ensure_captured(self, model: Any) -> None:
        """Capture for ``model`` unless done (the graphs hold one model's weights)."""
        if self.graphs is None:
            self._capture(model)
        elif model is not self._model:
            raise KVPlugError("kvplug's decode graphs were captured for another model instance")

    def _capture(self, model: Any) -> None:
        backend = self.cache.backend
        bar = _progress_bar(len(self.batch_sizes) if self.batch_sizes else None)

        def progress(done: int, total: int, size: int) -> None:
            if bar is not None:
                bar.total = total
                bar.update(1)
                bar.set_postfix_str(f"batch size {size}")

        try:
            self.graphs = backend.decode_graphs(
                self._forward_fn(model), batch_sizes=self.batch_sizes, max_batch_size=self.max_batch_size,
                progress=progress,
            )
        finally:
            if bar is not None:
                bar.close()
        self._model = model
        logger.info(
            "kvplug captured %d decode CUDA graphs (batch sizes up to %d%s) in %.1f s, using %.1f MiB of device memory",
            len(self.graphs.batch_sizes), self.graphs.batch_sizes[-1], ", torch.compile" if self.torch_compile else "",
            self.graphs.capture_seconds, self.graphs.capture_bytes / 2**20,
        )

    def _forward_fn(self, model: Any):
        cache, steps = self.cache, self.cache.steps
        # every layer is full attention (KVPlugPagedCache refuses other models): no mask to build
        masks = {"full_attention": None}
        # dynamic: one compilation serves every captured batch size (the token dimension varies)
        run_model = torch.compile(model, dynamic=True) if self.torch_compile else model

        def forward(step: "DecodeStep") -> torch.Tensor:
            with steps.forward_over(step):
                output = run_model(
                    input_ids=step.input_ids.view(1, -1), position_ids=step.positions.view(1, -1),
                    attention_mask=masks, cache=cache, use_cache=False,
                )
            return output.logits[0]

        return forward

    # ------------------------------------------------------------------ after the replay
    @staticmethod
    def _process_and_sample(runner: Any, logits: torch.Tensor, input_ids: torch.Tensor, batch_data: dict) -> None:
        """What transformers' ``_forward_process_and_sample`` does after the model's forward:
        its logits processors over the step's rows, then its sampler into ``output_ids``. A copy,
        not a call through (the original runs the forward too): the version gate fingerprints the
        original's source (``compat.INTERNALS``), so a change there stops the install.

        Args:
            logits: shape ``[live, vocab]``, model dtype, device.
            input_ids: shape ``[live]``, int32, device; the step's input tokens (kvplug's, read
                from its token pool: with async batching transformers' own ``input_ids`` still
                hold placeholders for the ids the previous step sampled).
        """
        scores = logits.float().unsqueeze(0)  # [1, live, vocab]
        if runner.logit_processor.do_processing:
            vocab = scores.shape[-1]
            processed = runner.logit_processor(input_ids, scores.view(-1, vocab), batch_data["logits_processor_args"])
            scores = processed.view(1, -1, vocab)
        runner._sample(scores, runner.inputs_and_outputs.output_ids)  # [1 or 2, max_batch_tokens + 1], int32


def graphs_for(cache: "KVPlugPagedCache", settings: Any) -> HostDecodeGraphs | None:
    """The cache's ``HostDecodeGraphs``, or ``None`` when graphs are off (``settings.cuda_graphs``
    False, or ``None`` off CUDA)."""
    backend = cache.backend
    wanted = settings.cuda_graphs
    if wanted is False or (wanted is None and backend.device.type != "cuda"):
        return None
    if backend.attention is None:
        raise InvalidArgumentError("CUDA-graph decode needs a kvplug attention backend")
    limit = backend.max_running_reqs
    max_bs = min(settings.cuda_graph_max_bs or limit, limit)
    sizes = settings.cuda_graph_batch_sizes
    if sizes is not None:
        sizes = tuple(size for size in sizes if size <= limit) or None
    return HostDecodeGraphs(cache, max_batch_size=max_bs, batch_sizes=sizes, torch_compile=settings.torch_compile)


def _progress_bar(total: int | None) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # transformers depends on tqdm; without it, the log line is the report
        return None
    # disable=None: no bar when the output is not a terminal (a log file), the log line stays
    return tqdm(total=total, desc="kvplug: capturing decode CUDA graphs", unit="graph", leave=False, disable=None)
