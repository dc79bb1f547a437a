"""``StepProgress``: how far the device has come through a ring of staged steps, read on the host
without a sync.

A ring reuses host memory that the device reads asynchronously (a copy's source, ``plan()``'s
copies), so the host may rewrite a slot only after the device passed every read of its last use.
Each staged step carries a number; the step's launch, on the stream after every earlier step's
reads, writes that number into one pinned, device-accessible int32 (``tensor``). Reading it is a
numpy load: no CUDA call. The host waits (a stream sync) only when the device is ``ring_size - 1``
steps behind. Numbers are 31 bits and compared modulo 2**31, so a long-running server never
overflows them.
"""

from __future__ import annotations

import torch

from kvplug.interface import KVPlugError

_MASK = (1 << 31) - 1
_HALF = 1 << 30


class StepProgressError(KVPlugError, RuntimeError):
    """The device did not report a step it must have run (a launch that does not write progress)."""


class StepProgress:
    """Step numbers of one ring of ``ring_size`` slots on ``device``.

    Attributes:
        tensor: shape ``[1]``, int32, cpu (pinned for CUDA); the last step number the device
            reported (a kernel argument, or a copy's destination).
    """

    def __init__(self, device: torch.device, ring_size: int) -> None:
        self.device = device
        self.ring_size = int(ring_size)
        self.tensor = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._reported = self.tensor.numpy()
        self._staged = 0  # steps begun so far

    def begin_step(self) -> int:
        """The next step's number, once the slot it takes is free on the host: the device has
        reported the step after that slot's last use (``ring_size`` steps back)."""
        step = self._staged = self._staged + 1
        needed = step - self.ring_size + 1
        if needed > 1 and not self.reached(needed):
            self._wait_for()
        return step & _MASK

    def reached(self, step: int) -> bool:
        """Whether the device reported ``step`` (or a later one)."""
        return ((int(self._reported[0]) - (step & _MASK)) & _MASK) < _HALF

    def report(self, step: torch.Tensor) -> None:
        """Report through a stream-ordered copy (paths without the kernel): ``step`` is shape
        ``[1]``, int32, on ``device``, holding the step's number."""
        self.tensor.copy_(step, non_blocking=True)

    def _wait_for(self) -> None:
        """Sync the stream: every read of the slot has then run. The previous step must have
        reported by then (a ring of one slot never sees its own step's report in time)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if not self.reached(self._staged - 1):
            raise StepProgressError(
                f"the device reported step {int(self._reported[0])} after a sync; expected at least "
                f"{(self._staged - 1) & _MASK} (every staged step's launch must report its number)"
            )
