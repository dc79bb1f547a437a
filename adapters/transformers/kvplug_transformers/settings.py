"""``KVPlugSettings``: how the adapter builds kvplug for a transformers continuous-batching run."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from kvplug.interface import InvalidArgumentError


@dataclass(frozen=True)
class KVPlugSettings:
    """Choices for the kvplug backend the adapter builds when transformers creates its paged cache.

    Attributes:
        prefix_cache: prefix cache by name (``kvplug.available("prefix_cache")``: ``radix``, ``naive``, ...).
        attention: attention backend by name, ``"P,D"`` for a prefill/decode pair, or ``"auto"``
            (torch on CPU; the best available GPU backend on CUDA).
        page_size: tokens per KV page. transformers' ``ContinuousBatchingConfig.block_size`` is
            ignored: the scheduler is told the kvplug page size instead.
        kv_memory: pool budget, bytes (int) or a fraction of free device memory (float in (0, 1]).
        num_pages: pool pages; overrides ``kv_memory``. With neither, the pool is sized from
            ``ContinuousBatchingConfig.num_blocks`` if set, else from free memory (CUDA: the
            config's ``max_memory_percent``; CPU: min(1 GiB, 25 % of available RAM)).
        max_running_reqs: page-table rows, i.e. requests holding KV at once.
        max_seq_len: longest request in tokens (``None``: the model's ``max_position_embeddings``).
            The pool must hold at least one request of this length.
        max_batch_tokens: tokens per forward step (``None``: the ContinuousBatchingConfig's, else
            2048 on CPU and 8192 on CUDA).
        backend_options: extra keyword options for ``kvplug.create_backend``.
        cuda_graphs: replay decode-only steps from CUDA graphs kvplug captures (the model's
            forward at padded batch sizes; prefill and mixed steps stay eager). ``None``: on
            CUDA only; ``True`` elsewhere runs the same padded steps eagerly (tests the path).
        cuda_graph_max_bs: the largest batch size captured (``None``: ``max_running_reqs``);
            larger decode steps run eagerly.
        cuda_graph_batch_sizes: the sizes captured (``None``: 1, 2, 4, 8, then steps of 8 up to
            ``cuda_graph_max_bs``).
        overlap_schedule: transformers' async batching: step N+1 is scheduled and staged on the
            host while step N runs on the device (kvplug commits each step on the device, so the
            next one needs no host sync). ``None``: on CUDA (it needs CUDA streams); ``False``:
            every step waits for the previous one's outputs (SGLang's
            ``--disable-overlap-schedule``).
        torch_compile: compile the model with ``torch.compile`` (dynamic batch size) before
            kvplug captures its decode graphs, so the graphs replay fused kernels (RMSNorm,
            rotary, activations) instead of the model's eager ones; kvplug's attention stays
            outside the compiled graphs. Costs compile time at the first capture. Off by default
            (SGLang's ``--enable-torch-compile``).
        host_memory: a host-memory tier under the ``radix`` prefix cache: bytes or a size string
            (``"32GiB"``) of pinned host memory that keeps evicted prefixes and loads them back on
            a hit (``None``: no tier). Passed to the prefix cache as its ``host_memory`` option.
        remote_kv, remote_kv_model: a shared KV store's URL under the host tier and the model's
            identity in its keys (issue 30; the prefix cache's options of the same names).
        defer_host_loads: keep a request whose prefix is being copied back from the host tier
            out of the steps until the copy is done, so the requests already running do not
            wait for it. Off by default: the request joins at once and its first step waits for
            the copy on the device. Deferring was the slower of the two on the H200
            long-context-chat benchmark (figures in BENCHMARKS.md): a loading request holds a
            page-table row while it waits, and the requests it lets run are too few to hide the copy.
    """

    prefix_cache: str = "radix"
    attention: str = "auto"
    page_size: int = 16
    kv_memory: int | float | None = None
    num_pages: int | None = None
    max_running_reqs: int = 128
    max_seq_len: int | None = None
    max_batch_tokens: int | None = None
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    cuda_graphs: bool | None = None
    cuda_graph_max_bs: int | None = None
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    overlap_schedule: bool | None = None
    torch_compile: bool = False
    host_memory: int | str | None = None
    defer_host_loads: bool = False
    remote_kv: str | None = field(default=None, repr=False)  # issue 30; may hold a password
    remote_kv_model: str | None = None

    def __post_init__(self) -> None:
        for name in ("prefix_cache", "attention"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise InvalidArgumentError(f"{name} must be a non-empty component name, got {value!r}")
        for name in ("page_size", "max_running_reqs"):
            _check_positive_int(name, getattr(self, name))
        for name in ("cuda_graphs", "overlap_schedule"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be None, True or False, got {getattr(self, name)!r}")
        for name in ("torch_compile", "defer_host_loads"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.torch_compile and self.cuda_graphs is False:
            raise InvalidArgumentError("torch_compile compiles the model kvplug captures in its decode graphs; "
                                       "it has no effect with cuda_graphs=False")
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None:
            if not isinstance(sizes, (tuple, list)) or not sizes:
                raise InvalidArgumentError(f"cuda_graph_batch_sizes must be a non-empty tuple of ints, got {sizes!r}")
            for size in sizes:
                _check_positive_int("cuda_graph_batch_sizes entries", size)
            object.__setattr__(self, "cuda_graph_batch_sizes", tuple(sorted(set(sizes))))
        for name in ("num_pages", "max_seq_len", "max_batch_tokens", "cuda_graph_max_bs"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        memory = self.kv_memory
        if memory is not None:
            if isinstance(memory, bool) or not isinstance(memory, (int, float)):
                raise InvalidArgumentError(f"kv_memory must be bytes (int) or a fraction (float), got {memory!r}")
            if isinstance(memory, float) and not 0.0 < memory <= 1.0:
                raise InvalidArgumentError(f"kv_memory as a fraction must lie in (0, 1], got {memory!r}")
            if isinstance(memory, int) and memory < 1:
                raise InvalidArgumentError(f"kv_memory in bytes must be positive, got {memory!r}")
        if self.host_memory is not None:
            from kvplug.memory.capacity import parse_memory_size

            parse_memory_size(self.host_memory)  # raises InvalidArgumentError naming the accepted forms
        if not isinstance(self.backend_options, Mapping):
            raise InvalidArgumentError(f"backend_options must be a mapping, got {self.backend_options!r}")

    def updated(self, **changes: Any) -> "KVPlugSettings":
        """A copy with ``changes`` applied; unknown names are an error listing the valid ones."""
        known = {item.name for item in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InvalidArgumentError(f"unknown kvplug setting(s) {unknown}; expected some of {sorted(known)}")
        return replace(self, **changes)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
