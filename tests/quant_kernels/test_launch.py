"""quant_kernels._launch: which calls reuse a compiled kernel and which go through Triton.

Triton's own launch path is replaced by a recorder (``JITFunction.run``), so this runs on any
machine; the real kernels take the cached path on a GPU in every other kernel test.
"""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from quant_kernels import _launch  # noqa: E402


def _body(x_ptr, n, scale, BLOCK: tl.constexpr):
    pass


# a JITFunction as on a GPU (``triton.jit`` makes an interpreted function under
# TRITON_INTERPRET=1, which the CPU test session sets)
_kernel = triton.runtime.jit.JITFunction(_body)


class _Compiled:
    """Stands in for a CompiledKernel: records ``compiled[grid](*args)``."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args: self.calls.append((grid, args))


@pytest.fixture
def triton_path(monkeypatch):
    """Triton's own path (``kernel[grid](...)``), recorded; it returns one fake compiled
    kernel, whose launches are recorded too."""
    calls: list[tuple] = []
    compiled = _Compiled()

    def run(self, *args, grid, warmup, **kwargs):
        calls.append((grid, args, kwargs))
        return compiled

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", run)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_launch, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(_launch, "_CACHE", {})
    return calls, compiled


def test_a_repeated_call_reuses_the_compiled_kernel_with_every_argument(triton_path):
    calls, compiled = triton_path
    x = torch.zeros(64)
    _launch.launch(_kernel, (4,), x, 10, 0.5, BLOCK=32, num_warps=4)
    assert len(calls) == 1 and calls[0][1] == (x, 10, 0.5)
    assert calls[0][2] == {"BLOCK": 32, "num_warps": 4} and compiled.calls == []
    # the same specialization (floats are not specialized): the compiled kernel, the grid padded
    # to three dimensions, the constexpr passed in signature order, the launch option not
    _launch.launch(_kernel, (4, 2), x, 10, 0.25, BLOCK=32, num_warps=4)
    assert len(calls) == 1
    assert compiled.calls == [((4, 2, 1), (x, 10, 0.25, 32))]


@pytest.mark.parametrize(
    "change",
    ["int", "misaligned", "dtype", "constexpr", "num_warps", "bool"],
)
def test_anything_triton_specializes_on_goes_through_triton(triton_path, change):
    calls, compiled = triton_path
    x = torch.zeros(64)
    _launch.launch(_kernel, (4,), x, 10, 0.5, BLOCK=32, num_warps=4)
    args, meta = [x, 10, 0.5], {"BLOCK": 32, "num_warps": 4}
    if change == "int":
        args[1] = 11
    elif change == "misaligned":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float64)
    elif change == "constexpr":
        meta["BLOCK"] = 64
    elif change == "num_warps":
        meta["num_warps"] = 8
    else:
        args[1] = True  # a bool is not the int 1
        _launch.launch(_kernel, (4,), x, 1, 0.5, BLOCK=32, num_warps=4)
    _launch.launch(_kernel, (4,), *args, **meta)
    assert len(calls) == (3 if change == "bool" else 2) and compiled.calls == []


def test_switched_off_or_interpreted_it_is_always_triton(triton_path, monkeypatch):
    calls, compiled = triton_path
    x = torch.zeros(64)
    monkeypatch.setattr(_launch, "DIRECT_LAUNCH", False)
    for _ in range(2):
        _launch.launch(_kernel, (4,), x, 10, 0.5, BLOCK=32, num_warps=4)
    monkeypatch.setattr(_launch, "DIRECT_LAUNCH", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for _ in range(2):
        _launch.launch(_kernel, (4,), x, 10, 0.5, BLOCK=32, num_warps=4)
    assert len(calls) == 4 and compiled.calls == [] and _launch._CACHE == {}


def test_a_missing_argument_is_never_cached(triton_path):
    calls, compiled = triton_path
    x = torch.zeros(64)
    for _ in range(2):  # BLOCK left to Triton (here: its error; a default would do the same)
        _launch.launch(_kernel, (4,), x, 10, 0.5, num_warps=4)
    assert len(calls) == 2 and compiled.calls == [] and _launch._CACHE == {}
