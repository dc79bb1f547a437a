"""Launching kvplug's Triton kernels at a fraction of ``kernel[grid](...)``'s host cost.

``kernel[grid](...)`` binds every argument, derives the specialization key (dtypes, 16-byte
alignment of pointers, integer sizes and divisibility), looks the compiled kernel up and builds
launch metadata for hooks: several times the host time of the launch itself (BENCHMARKS.md).
Eager decode launches three kernels per layer, so this is most of an eager
step's host time. ``FastLauncher`` keeps the compiled kernel per *its own* key (the same facts:
dtype and 16-byte alignment of each tensor, 32-bit range, ``== 1`` and ``% 16 == 0`` of each int,
the constexprs and launch options) and calls the compiled launcher directly after the first
launch, which goes through Triton as usual (compiling if needed).

The direct call is Triton-version specific: it is used only on the versions it was verified on
(``VERIFIED_TRITON``) and only while no launch hooks are registered (profilers register them);
otherwise, or with ``KVPLUG_TRITON_FAST_LAUNCH=0``, every launch goes through Triton. Either way
the kernel and its arguments are the same, so results are identical (tested on the GPU; the
bookkeeping also on CPU with a stand-in kernel). Triton is imported where it is used.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch

VERIFIED_TRITON = ("3.6.",)
LAUNCH_OPTIONS = ("num_warps", "num_stages")
_THROUGH_TRITON = object()  # a key the direct call cannot serve (constexpr order, hooks)


def fast_path_available() -> bool:
    """Whether this Triton is one the direct call was verified on, and it is not turned off."""
    if os.environ.get("KVPLUG_TRITON_FAST_LAUNCH", "1") == "0":
        return False
    import triton

    return triton.__version__.startswith(VERIFIED_TRITON)


def _hooks_registered() -> bool:
    from triton import knobs

    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", None) != []:
            return True
    return False


def _argument_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or not isinstance(value, int):
        return type(value)
    return -(1 << 31) <= value < (1 << 31), value == 1, value % 16 == 0


def _address(value: Any) -> Any:
    """A CUDA tensor's address (what the compiled launcher would read from it), else ``value``."""
    return value.data_ptr() if isinstance(value, torch.Tensor) and value.is_cuda else value


def _launch_key(args: tuple, keywords: dict) -> tuple:
    """The facts a compiled kernel is specialised on, plus the device."""
    return (torch.cuda.current_device(), tuple(keywords.items()), *map(_argument_key, args))


def _positional(args: tuple, keywords: dict) -> tuple:
    """The compiled launcher's arguments: runtime args, then the constexprs (not launch options)."""
    return (*args, *(value for name, value in keywords.items() if name not in LAUNCH_OPTIONS))


class FastLauncher:
    """Launches one ``@triton.jit`` kernel (see the module docstring).

    Call as ``launcher(grid, *runtime_args, **constexprs_and_options)``: ``runtime_args`` are the
    kernel's non-constexpr parameters in order, then its constexprs by name in signature order,
    then launch options (``num_warps``, ``num_stages``).
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.enabled = fast_path_available()
        self._compiled: dict[tuple, Any] = {}
        self._stream = None

    def __call__(self, grid: Sequence[int], *args: Any, **keywords: Any) -> None:
        if not self.enabled:
            self.kernel[grid](*args, **keywords)
            return
        self._launch(_launch_key(args, keywords), grid, args, keywords, _positional(args, keywords))

    def bind(self, grid: Sequence[int], *args: Any, **keywords: Any) -> Callable[[], None]:
        """A launch of exactly these arguments, for a caller that repeats it over persistent
        buffers (whose values change, not their addresses): the key is derived once, here, so
        each call costs the launch alone (on the stream current at the call)."""
        return self.bind_all_but((), grid, *args, **keywords)

    def _launch(self, key: tuple, grid: Sequence[int], args: tuple, keywords: dict, arguments: tuple) -> None:
        """Launch through the compiled kernel of ``key`` (``arguments``: runtime args then
        constexprs), or through Triton the first time and wherever the direct call cannot serve."""
        compiled = self._compiled.get(key)
        if compiled is None:
            self._first_launch(key, grid, args, keywords)
            return
        if compiled is _THROUGH_TRITON:
            self.kernel[grid](*args, **keywords)
            return
        self._run(compiled, (*grid, 1, 1)[:3], key[0], arguments)

    def _run(self, compiled: Any, grid_xyz: tuple, device: int, arguments: Sequence[Any]) -> None:
        """The direct call of a compiled kernel (Triton 3.6's launcher signature: hooks and
        scratch allocations none) on ``device``'s current stream."""
        compiled.run(
            *grid_xyz, self._stream(device), compiled.function, compiled.packed_metadata, None, None, None, *arguments
        )

    def bind_all_but(
        self, positions: int | Sequence[int], grid: Sequence[int], *args: Any, **keywords: Any
    ) -> Callable[..., None]:
        """``bind`` with the runtime arguments at ``positions`` given per call: ``launch(value,
        ...)``, one value per position, in the order of ``positions``. ``args`` holds examples
        there; values whose specialization differs from the examples' (dtype, 16-byte alignment,
        integer class) go through ``__call__``. The examples are not kept; the other arguments
        are (the launch reads them every call).

        After the first launch a call costs the compiled launcher's call: CUDA tensors are
        passed as their addresses (the bound ones taken once, here), which spares the launcher
        a ``data_ptr()`` call and a driver query per pointer. Host tensors (pinned memory) are
        passed as tensors, for the launcher to map."""
        positions = (positions,) if isinstance(positions, int) else tuple(positions)
        example_keys = tuple(_argument_key(args[position]) for position in positions)
        bound = list(args)
        for position in positions:
            bound[position] = None  # not kept alive by the launch

        def with_values(values: tuple) -> list:
            runtime = bound.copy()
            for position, value in zip(positions, values):
                runtime[position] = value
            return runtime

        if not self.enabled:
            return lambda *values: self.kernel[grid](*with_values(values), **keywords)
        key = _launch_key(args, keywords)
        constexprs = _positional((), keywords)
        # the direct call's arguments: bound CUDA tensors as addresses (``bound`` keeps them alive)
        template = [_address(value) for value in bound] + list(constexprs)
        grid_xyz = (*grid, 1, 1)[:3]
        resolved: list = [None]  # the compiled kernel (or _THROUGH_TRITON), once known

        def through_triton(values: tuple) -> None:
            runtime = with_values(values)
            if tuple(map(_argument_key, values)) != example_keys:
                self(grid, *runtime, **keywords)
                return
            self._launch(key, grid, tuple(runtime), keywords, (*runtime, *constexprs))
            resolved[0] = self._compiled.get(key)

        def launch(*values: Any) -> None:
            compiled = resolved[0]
            if compiled is None or compiled is _THROUGH_TRITON:
                through_triton(values)
                return
            full = template.copy()
            for position, value, example in zip(positions, values, example_keys):
                if isinstance(value, torch.Tensor):  # _argument_key inlined: data_ptr() read once
                    address = value.data_ptr()
                    if value.dtype != example[0] or (address % 16 == 0) != example[1]:
                        through_triton(values)
                        return
                    full[position] = address if value.is_cuda else value
                elif _argument_key(value) != example:
                    through_triton(values)
                    return
                else:
                    full[position] = value
            self._run(compiled, grid_xyz, key[0], full)

        return launch

    def _first_launch(self, key: tuple, grid: Sequence[int], args: tuple, keywords: dict) -> None:
        compiled = self.kernel[grid](*args, **keywords)
        constexpr_names = [name for name in keywords if name not in LAUNCH_OPTIONS]
        # the direct call passes runtime args then constexprs positionally: only valid when that
        # is the signature's order, and while no launch hook expects its metadata
        in_order = list(self.kernel.arg_names) == [*self.kernel.arg_names[: len(args)], *constexpr_names]
        if compiled is None:
            return
        if not in_order or _hooks_registered():
            self._compiled[key] = _THROUGH_TRITON  # decided once: later launches skip these checks
            return
        if self._stream is None:
            import triton

            self._stream = triton.runtime.driver.active.get_current_stream
        self._compiled[key] = compiled
