"""``FastLauncher``'s bookkeeping on CPU, with a stand-in for a ``@triton.jit`` kernel: the first
launch of each specialization goes through ``kernel[grid]``, later ones straight to the compiled
launcher with runtime args then constexprs in signature order; anything it cannot vouch for
(another alignment or integer class, constexprs out of order, launch hooks, the switch off) goes
through Triton. The GPU tests check the real kernels' results."""

from __future__ import annotations

import pytest
import torch

from kvplug.kernels import launch


class FakeCompiled:
    function, packed_metadata = "function", "packed"

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, *call) -> None:
        self.log.append(("direct", call))


class FakeKernel:
    arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]

    def __init__(self) -> None:
        self.log: list = []

    def __getitem__(self, grid):
        def launch_through_triton(*args, **keywords):
            self.log.append(("triton", grid, args, keywords))
            return FakeCompiled(self.log)

        return launch_through_triton


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(launch, "fast_path_available", lambda: True)
    monkeypatch.setattr(launch, "_hooks_registered", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fast = launch.FastLauncher(FakeKernel())
    fast._stream = lambda device: f"stream{device}"
    return fast


def kinds(fast) -> list[str]:
    return [entry[0] for entry in fast.kernel.log]


def test_first_launch_through_triton_then_direct_in_signature_order(launcher):
    x = torch.zeros(64, dtype=torch.int32)
    launcher((4,), x, 100, BLOCK=128, FLAG=True, num_warps=4)
    launcher((5, 2), x, 200, BLOCK=128, FLAG=True, num_warps=4)
    assert kinds(launcher) == ["triton", "direct"]
    assert launcher.kernel.log[1][1] == (5, 2, 1, "stream0", "function", "packed", None, None, None, x, 200, 128, True)


def test_a_new_specialization_goes_through_triton_first(launcher):
    x = torch.zeros(64, dtype=torch.int32)
    launcher((1,), x, 100, BLOCK=128, FLAG=True)
    launcher((1,), x[1:], 100, BLOCK=128, FLAG=True)  # 4 bytes in: not 16-byte aligned
    launcher((1,), x, 96, BLOCK=128, FLAG=True)  # a multiple of 16
    launcher((1,), x, 1, BLOCK=128, FLAG=True)  # 1 is specialised
    launcher((1,), x, 1 << 40, BLOCK=128, FLAG=True)  # past 32 bits
    launcher((1,), x.float(), 100, BLOCK=128, FLAG=True)  # another dtype
    launcher((1,), x, 100, BLOCK=64, FLAG=True)  # another constexpr
    launcher((1,), x, 100, BLOCK=128, FLAG=True, num_warps=8)  # another launch option
    assert kinds(launcher) == ["triton"] * 8
    launcher((1,), x, 101, BLOCK=128, FLAG=True)  # same class as 100: direct
    assert kinds(launcher)[-1] == "direct"


def test_out_of_order_constexprs_hooks_or_the_switch_keep_triton_launching(launcher, monkeypatch):
    x = torch.zeros(64, dtype=torch.int32)
    for _ in range(2):
        launcher((1,), x, 100, FLAG=True, BLOCK=128)  # keywords not in signature order
    assert kinds(launcher) == ["triton", "triton"]
    assert launch._THROUGH_TRITON in launcher._compiled.values()  # decided once, not re-checked
    monkeypatch.setattr(launch, "_hooks_registered", lambda: True)
    for _ in range(2):
        launcher((1,), x, 100, BLOCK=128, FLAG=True)
    assert kinds(launcher) == ["triton"] * 4
    monkeypatch.undo()  # the real fast_path_available: the switch is read before Triton is imported
    monkeypatch.setenv("KVPLUG_TRITON_FAST_LAUNCH", "0")
    assert launch.fast_path_available() is False


def test_bound_launch_fixes_arguments_and_reads_the_stream_each_call(launcher):
    x = torch.zeros(64, dtype=torch.int32)
    bound = launcher.bind((3,), x, 100, BLOCK=128, FLAG=False, num_stages=2)
    bound()
    bound()
    launcher._stream = lambda device: "capture-stream"
    bound()
    assert kinds(launcher) == ["triton", "direct", "direct"]
    assert launcher.kernel.log[1][1] == (3, 1, 1, "stream0", "function", "packed", None, None, None, x, 100, 128, False)
    assert launcher.kernel.log[2][1][3] == "capture-stream"
    # the plain call shares the bound launch's compiled kernel
    launcher((3,), x, 100, BLOCK=128, FLAG=False, num_stages=2)
    assert kinds(launcher)[-1] == "direct"


def test_disabled_launcher_always_goes_through_triton(monkeypatch):
    monkeypatch.setattr(launch, "fast_path_available", lambda: False)
    fast = launch.FastLauncher(FakeKernel())
    x = torch.zeros(64, dtype=torch.int32)
    fast((1,), x, 100, BLOCK=128, FLAG=True)
    fast((1,), x, 100, BLOCK=128, FLAG=True)
    bound = fast.bind((1,), x, 100, BLOCK=128, FLAG=True)
    bound()
    assert kinds(fast) == ["triton"] * 3


def test_bind_all_but_one_argument_takes_it_per_call_and_checks_its_specialization(launcher):
    x = torch.zeros(64, dtype=torch.int32)
    other, misaligned = torch.ones(64, dtype=torch.int32), torch.ones(64, dtype=torch.int32)[1:]
    launch_with = launcher.bind_all_but(0, (2,), x, 100, BLOCK=128, FLAG=True)
    launch_with(x)  # first: through Triton (__call__ compiles and records the key)
    launch_with(other)  # same specialization: direct, with the value given
    launch_with(misaligned)  # another specialization: through __call__, which launches via Triton
    assert kinds(launcher) == ["triton", "direct", "triton"]
    assert launcher.kernel.log[1][1][9] is other
    launch_with(misaligned)  # __call__ has that key now: direct
    assert kinds(launcher)[-1] == "direct"


def test_bind_all_but_several_arguments_takes_each_per_call(launcher):
    x = torch.zeros(64, dtype=torch.int32)
    y, z = torch.ones(64, dtype=torch.int32), torch.full((64,), 2, dtype=torch.int32)
    launcher.kernel.arg_names = ["x_ptr", "n", "y_ptr", "BLOCK", "FLAG"]
    launch_with = launcher.bind_all_but((0, 2), (2,), x, 100, x, BLOCK=128, FLAG=True)
    launch_with(y, z)  # first: through Triton
    launch_with(z, y)  # same specializations: direct, the values in their positions
    assert kinds(launcher) == ["triton", "direct"]
    assert launcher.kernel.log[1][1][9] is z and launcher.kernel.log[1][1][11] is y
    assert launcher.kernel.log[1][1][10] == 100
    launch_with(y, torch.ones(64, dtype=torch.float32))  # the second's dtype differs: through __call__
    assert kinds(launcher)[-1] == "triton"


class PretendCudaTensor(torch.Tensor):
    """A CPU tensor that says it is on CUDA: what the launcher does with CUDA tensors, on the CPU."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_direct_bound_launches_pass_cuda_tensors_as_addresses(launcher):
    """Bound CUDA tensors reach the compiled launcher as their addresses (taken at bind time),
    per-call ones as theirs; host tensors stay tensors (the launcher maps pinned memory)."""
    x = torch.Tensor._make_subclass(PretendCudaTensor, torch.zeros(64, dtype=torch.int32))
    y, z = (torch.Tensor._make_subclass(PretendCudaTensor, torch.ones(64, dtype=torch.int32)) for _ in range(2))
    host = torch.ones(64, dtype=torch.int32)
    launcher.kernel.arg_names = ["x_ptr", "n", "y_ptr", "BLOCK", "FLAG"]
    launch_with = launcher.bind_all_but(2, (2,), x, 100, y, BLOCK=128, FLAG=True)
    launch_with(y)  # through Triton, with the tensors themselves
    assert launcher.kernel.log[0][2][0] is x and launcher.kernel.log[0][2][2] is y
    launch_with(z)
    launch_with(host)
    assert kinds(launcher) == ["triton", "direct", "direct"]
    assert launcher.kernel.log[1][1][9:] == (x.data_ptr(), 100, z.data_ptr(), 128, True)
    assert launcher.kernel.log[2][1][11] is host
