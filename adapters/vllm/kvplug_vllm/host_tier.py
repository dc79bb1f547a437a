"""The worker side of kvplug's host tier in vLLM: the host pages and the copies the scheduler decided.

``WorkerHostTier`` holds, for each KV cache tensor vLLM registered (``register_kv_caches``), a host
buffer of ``num_pages`` blocks (pinned when the KV cache is on CUDA), laid out as that tensor with
its block dimension resized. ``apply`` makes the scheduler's ``HostCopy`` list in order: ``save``
gathers blocks into host pages, ``load`` scatters host pages into blocks. It runs from
``start_load_kv`` before the step's forward (the connector marks such steps as having sync loads),
on the current stream, so a write-back reads a reused block before the forward overwrites it and a
load lands before any layer reads it.

No vLLM import.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from kvplug.interface import InvalidArgumentError, OutOfMemoryError
from kvplug.memory.host_tier_size import check_host_tier_fits

from kvplug_vllm.host_copies import LOAD, SAVE, HostCopy


def block_dim(tensor: torch.Tensor, num_blocks: int, name: str) -> tuple[int, int]:
    """``(dimension, kernel blocks per vLLM block)`` of a KV cache tensor: the leading dimension
    that indexes blocks, of ``num_blocks`` or a multiple (an attention kernel's smaller blocks)."""
    leading = range(min(2, tensor.dim()))
    dims = [dim for dim in leading if tensor.shape[dim] == num_blocks]
    if not dims:
        dims = [dim for dim in leading if tensor.shape[dim] > num_blocks and tensor.shape[dim] % num_blocks == 0]
    if len(dims) != 1:
        raise InvalidArgumentError(
            f"kvplug's host tier expects {name}'s KV cache to have one leading dimension of {num_blocks} blocks "
            f"(or a multiple), got shape {tuple(tensor.shape)}")
    return dims[0], tensor.shape[dims[0]] // num_blocks


class WorkerHostTier:
    """Host pages for every KV cache tensor of one worker (see the module docstring).

    Args:
        kv_caches: vLLM's layer name -> KV cache tensor (layers sharing a tensor are copied once).
        num_blocks: vLLM's blocks per tensor.
        num_pages: host pages, as the scheduler sized them.
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int, num_pages: int) -> None:
        if num_pages < 1:
            raise InvalidArgumentError(f"the host tier needs at least one page, got {num_pages}")
        tensors: dict[int, tuple[torch.Tensor, int, int]] = {}
        for name, tensor in kv_caches.items():
            if not isinstance(tensor, torch.Tensor):
                raise InvalidArgumentError(f"kvplug's host tier copies tensors; {name}'s KV cache is {type(tensor)}")
            tensors.setdefault(tensor.data_ptr(), (tensor, *block_dim(tensor, num_blocks, name)))
        self.num_pages = num_pages
        self._device: list[tuple[torch.Tensor, int, int]] = list(tensors.values())
        self.bytes_per_page = sum(t.numel() // t.shape[dim] * per * t.element_size() for t, dim, per in self._device)
        check_host_tier_fits(num_pages * self.bytes_per_page)
        try:
            self._host = [self._host_buffer(tensor, dim, per) for tensor, dim, per in self._device]
        except (RuntimeError, MemoryError) as error:
            raise OutOfMemoryError(
                f"cannot allocate kvplug's host tier: {num_pages:,} pages of {self.bytes_per_page:,} bytes: {error}"
            ) from error
        self.saved_pages = 0
        self.loaded_pages = 0

    def _host_buffer(self, tensor: torch.Tensor, dim: int, per: int) -> torch.Tensor:
        shape = list(tensor.shape)
        shape[dim] = self.num_pages * per
        return torch.empty(shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)

    def apply(self, copies: Sequence[HostCopy]) -> None:
        """Make ``copies`` in order (see the module docstring)."""
        for copy in copies:
            if copy.kind == SAVE:
                self._save(copy.block_ids, copy.host_pages)
            elif copy.kind == LOAD:
                self._load(copy.host_pages, copy.block_ids)
            else:
                raise InvalidArgumentError(f"unknown host copy {copy.kind!r}; expected {SAVE!r} or {LOAD!r}")

    def _save(self, block_ids: Sequence[int], host_pages: Sequence[int]) -> None:
        for (tensor, dim, per), host in zip(self._device, self._host):
            pages = _kernel_blocks(host_pages, per, torch.device("cpu"))
            blocks = _kernel_blocks(block_ids, per, tensor.device)
            host.index_copy_(dim, pages, tensor.index_select(dim, blocks).to("cpu"))
        self.saved_pages += len(host_pages)

    def _load(self, host_pages: Sequence[int], block_ids: Sequence[int]) -> None:
        for (tensor, dim, per), host in zip(self._device, self._host):
            pages = _kernel_blocks(host_pages, per, torch.device("cpu"))
            blocks = _kernel_blocks(block_ids, per, tensor.device)
            tensor.index_copy_(dim, blocks, host.index_select(dim, pages).to(tensor.device))
        self.loaded_pages += len(host_pages)


def _kernel_blocks(ids: Sequence[int], per: int, device: torch.device) -> torch.Tensor:
    """Block ids -> the ``per`` consecutive kernel blocks each one spans."""
    ids = torch.tensor(ids, dtype=torch.long)
    if per > 1:
        ids = (ids[:, None] * per + torch.arange(per)).reshape(-1)
    return ids.to(device)
