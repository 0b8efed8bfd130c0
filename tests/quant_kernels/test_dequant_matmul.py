"""Fused int8 dequant-matmul kernels vs bitsandbytes' dequantizer (CPU: Triton interpreter)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs a GPU or TRITON_INTERPRET=1 (set by tests/conftest.py)", allow_module_level=True
    )

bnb_functional = pytest.importorskip("bitsandbytes.functional")

from quant_kernels.dequant_matmul import int8_matmul, int8_matmul_t  # noqa: E402
from quant_kernels.reference import quantize_int8_rowwise  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative Frobenius error vs a float64 product of the same (rounded) operands
# (Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding, hence its looser bf16 bound)
TOL = {
    torch.float32: 1e-5 if DEVICE == "cpu" else 2e-3,
    torch.bfloat16: 2e-2 if DEVICE == "cpu" else 8e-3,
    torch.float16: 2e-3,
}
# odd shapes: none is a multiple of the interpreter's 16-wide tiles except the last
SHAPES = [(1, 17, 9), (33, 40, 50), (5, 3, 130), (64, 64, 64)]


def _bnb_weight(n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen).to(torch.float16)
    cb, scb, _ = bnb_functional.int8_vectorwise_quant(w.clone())
    ours = quantize_int8_rowwise(w)
    assert torch.equal(ours[0], cb) and torch.equal(ours[1], scb)
    deq = bnb_functional.int8_vectorwise_dequant(cb, scb).double()  # bnb's own dequantizer
    return cb.to(DEVICE), scb.to(DEVICE), deq


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_matches_bnb_dequant(m, k, n, dtype, gen):
    cb, scb, deq = _bnb_weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = int8_matmul(x.to(DEVICE), cb, scb)
    assert y.dtype == dtype and y.shape == (m, n)
    assert _rel(y, x.double() @ deq.t()) <= TOL[dtype]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backward_input_matches_bnb_dequant(m, k, n, dtype, gen):
    cb, scb, deq = _bnb_weight(n, k, gen)
    g = torch.randn(m, n, generator=gen).to(dtype)
    dx = int8_matmul_t(g.to(DEVICE), cb, scb)
    assert dx.dtype == dtype and dx.shape == (m, k)
    # the kernel rounds each dequantized tile to the activation dtype, as the reference does
    assert _rel(dx, g.double() @ deq.to(dtype).double()) <= TOL[dtype]


def test_leading_dims_and_strided_input(gen):
    cb, scb, deq = _bnb_weight(24, 40, gen)
    x = torch.randn(2, 3, 80, generator=gen)[..., ::2]  # non-contiguous last dim
    y = int8_matmul(x.to(DEVICE), cb, scb)
    assert y.shape == (2, 3, 24)
    assert _rel(y, x.double() @ deq.t()) <= TOL[torch.float32]


def test_shape_errors(gen):
    cb, scb, _ = _bnb_weight(8, 16, gen)
    with pytest.raises(ValueError, match="last dim"):
        int8_matmul(torch.randn(2, 8, device=DEVICE), cb, scb)
    with pytest.raises(ValueError, match="int8"):
        int8_matmul(torch.randn(2, 16, device=DEVICE), cb.float(), scb)


def test_autotune_pruning_keeps_tiles_near_m_and_small_fp32_tiles():
    from quant_kernels.dequant_matmul import _configs, prune_configs

    cfgs = _configs()

    def tiles(kept):
        return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) for c in kept}

    every = tiles(cfgs)
    assert tiles(prune_configs(cfgs, {"M": 8192}, IEEE=False)) == every
    # 33 rows (an evaluation batch): no tile taller than 64 rows
    small = tiles(prune_configs(cfgs, {"M": 33, "IEEE": False}))
    assert small == {t for t in every if t[0] <= 64} and small
    # 100 rows: up to 128-row tiles
    assert max(t[0] for t in tiles(prune_configs(cfgs, {"M": 100}, IEEE=False))) == 128
    # fp32 (IEEE products): at most 128 x 128 x 64
    fp32 = tiles(prune_configs(cfgs, {"M": 8192}, IEEE=True))
    assert fp32 == {t for t in every if t[0] * t[1] <= 128 * 128 and t[2] <= 64} and fp32
    # nothing fits: the smallest tile rather than none
    big = [c for c in cfgs if c.kwargs["BLOCK_M"] == 256]
    assert tiles(prune_configs(big, {"M": 1}, IEEE=True)) == {(256, 128, 64)}
