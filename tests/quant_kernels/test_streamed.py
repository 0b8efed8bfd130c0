"""Slab-streamed dequant-GEMM vs bitsandbytes' own dequantizers (CPU: Triton interpreter)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs a GPU or TRITON_INTERPRET=1 (set by tests/conftest.py)", allow_module_level=True
    )

F = pytest.importorskip("bitsandbytes.functional")

from quant_kernels.reference import dequant_int8_rowwise, quantize_int8_rowwise  # noqa: E402
from quant_kernels.streamed import (  # noqa: E402
    _band,
    fourbit_decoder,
    int8_decoder,
    streamed_matmul_fm,
    streamed_matmul_nn,
    streamed_matmul_nt,
    streamed_matmul_t_fm,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative Frobenius error vs a float64 product of the same rounded weight; the interpreter
# truncates fp32 -> bf16 where the GPU rounds, hence the looser CPU bf16 bound
TOL = {torch.float32: 1e-6 if DEVICE == "cpu" else 2e-3, torch.bfloat16: 2e-2}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double().cpu() - ref).norm() / ref.norm()).item()


def _int8_parts(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' ``CB`` / ``SCB`` of a random fp16 weight, on DEVICE."""
    w = torch.randn(n, k, generator=gen).to(torch.float16)
    cb, scb, _ = F.int8_vectorwise_quant(w)
    return cb.to(DEVICE), scb.to(DEVICE)


def _int8(n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen).to(torch.float16)
    cb, scb, _ = F.int8_vectorwise_quant(w.clone())
    assert all(torch.equal(a, b) for a, b in zip(quantize_int8_rowwise(w)[:2], (cb, scb)))
    deq = dequant_int8_rowwise(cb, scb)  # fp32: CB·(SCB/127), the rounding the slab reproduces
    # bitsandbytes forms (CB·SCB)·(1/127): the same value to within an ulp
    torch.testing.assert_close(deq, F.int8_vectorwise_dequant(cb, scb).float(), rtol=3e-7, atol=0)
    return int8_decoder(cb.to(DEVICE), scb.to(DEVICE)), deq


def _4bit(
    n: int, k: int, quant_type: str, double_quant: bool, gen: torch.Generator, lut: str = "gather"
):
    w = torch.randn(n, k, generator=gen)
    packed, st = F.quantize_4bit(
        w.clone(), blocksize=64, quant_type=quant_type, compress_statistics=double_quant
    )
    deq = F.dequantize_4bit(packed, st).float()
    absmax = st.absmax.float()
    if double_quant:
        absmax = (F.dequantize_blockwise(st.absmax, st.state2) + st.offset).float()
    code = st.code.float().to(DEVICE)
    dec = fourbit_decoder(packed.to(DEVICE), absmax.to(DEVICE), code, 64, k, lut=lut)
    return dec, deq


@pytest.mark.parametrize("rect", [(0, 7, 0, 40), (2, 5, 17, 23), (6, 1, 39, 1)])
def test_int8_slab_equals_reference_dequant_exactly(rect, gen):
    dec, deq = _int8(7, 40, gen)
    r0, rows, c0, cols = rect
    buf = torch.full((rows * cols + 5,), float("nan"), device=DEVICE)
    slab = dec(buf, r0, rows, c0, cols)
    assert slab.shape == (rows, cols)
    assert torch.equal(slab.cpu(), deq[r0 : r0 + rows, c0 : c0 + cols])


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("lut", ["gather", "select"])
def test_4bit_slab_equals_bnb_dequant_exactly(quant_type, double_quant, lut, gen):
    dec, deq = _4bit(9, 192, quant_type, double_quant, gen, lut)
    buf = torch.empty(9 * 192, device=DEVICE)
    # even offsets and widths take the byte-pair kernel; odd ones the per-element kernel
    rects = ((0, 9, 0, 192), (1, 3, 64, 128), (3, 6, 2, 62), (2, 5, 63, 66), (8, 1, 191, 1),
             (1, 3, 1, 130))  # fmt: skip
    for r0, rows, c0, cols in rects:
        slab = dec(buf, r0, rows, c0, cols)  # nibble order and block boundaries
        assert torch.equal(slab.cpu(), deq[r0 : r0 + rows, c0 : c0 + cols])


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("tile", [(4, 128, 1), (2, 64, 1), (8, 256, 2)])
@pytest.mark.parametrize("lut", ["gather", "select"])
def test_4bit_per_block_slab_equals_bnb_dequant_exactly(double_quant, tile, lut, gen):
    """The whole-block kernel (one absmax load per block): block-aligned slabs, partial last
    blocks, and the offsets it hands back to the pair / per-element kernels."""
    packed, st = F.quantize_4bit(torch.randn(9, 192, generator=gen), blocksize=64, quant_type="nf4",
                                 compress_statistics=double_quant)  # fmt: skip
    deq = F.dequantize_4bit(packed, st).float()
    absmax = st.absmax.float()
    if double_quant:
        absmax = (F.dequantize_blockwise(st.absmax, st.state2) + st.offset).float()
    per_block = fourbit_decoder(packed.to(DEVICE), absmax.to(DEVICE), st.code.float().to(DEVICE),
                                64, 192, lut=lut, tile=tile, per_block=True)  # fmt: skip
    buf = torch.full((9 * 192,), float("nan"), device=DEVICE)
    rects = ((0, 9, 0, 192), (1, 3, 64, 128), (2, 5, 128, 64), (0, 9, 0, 100), (4, 5, 64, 30),
             (3, 6, 2, 62), (2, 5, 63, 66))  # fmt: skip
    for r0, rows, c0, cols in rects:
        slab = per_block(buf, r0, rows, c0, cols)
        assert torch.equal(slab.cpu(), deq[r0 : r0 + rows, c0 : c0 + cols]), (r0, rows, c0, cols)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_tiles_and_kernels_give_the_same_bf16_slab(quant_type, gen):
    """Every kernel and tile rounds the same fp32 values to bf16 (the interpreter
    truncates where the GPU rounds, so the oracle is the gather lookup on the same device; the
    fp32 test above checks that one against bnb); on a GPU also bnb's weight rounded to bf16."""
    n, k = 9, 192
    w = torch.randn(n, k, generator=gen)
    packed, st = F.quantize_4bit(w.clone(), blocksize=64, quant_type=quant_type)
    deq = F.dequantize_4bit(packed, st).float()
    args = (packed.to(DEVICE), st.absmax.float().to(DEVICE), st.code.float().to(DEVICE), 64, k)
    oracle = fourbit_decoder(*args)
    settings = ((None, True), ((4, 128, 1), True), ((2, 64, 1), True), ((8, 256, 2), False))
    others = [fourbit_decoder(*args, tile=tile, per_block=pb) for tile, pb in settings]
    for r0, rows, c0, cols in ((0, 9, 0, 192), (1, 3, 64, 128), (3, 6, 2, 62), (8, 1, 190, 2)):
        want = oracle(torch.empty(n * k, device=DEVICE, dtype=torch.bfloat16), r0, rows, c0, cols)
        if DEVICE == "cuda":
            assert torch.equal(want.cpu(), deq[r0 : r0 + rows, c0 : c0 + cols].bfloat16())
        for dec in others:
            nan = torch.full((n * k,), float("nan"), device=DEVICE, dtype=torch.bfloat16)
            assert torch.equal(
                dec(nan, r0, rows, c0, cols).view(torch.int16), want.view(torch.int16)
            )


def test_int8_slab_with_another_tile_equals_reference(gen):
    cb, scb = _int8_parts(37, 300, gen)
    deq = dequant_int8_rowwise(cb.cpu(), scb.cpu())
    buf = torch.empty(37 * 300, device=DEVICE)
    for tile in ((4, 64, 1), (8, 256, 8)):  # ragged in both directions
        small = int8_decoder(cb, scb, tile=tile)
        assert torch.equal(small(buf, 3, 30, 5, 290).cpu(), deq[3:33, 5:295])
        assert torch.equal(small(buf, 0, 37, 0, 300).cpu(), deq)


def test_int8_slab_divides_scb_by_127_correctly_rounded(gen):
    """The kernel forms ``SCB/127`` itself (no per-call torch ops): IEEE division, as the
    reference, not a multiply by the rounded ``1/127`` (which differs for some rows here)."""
    n, k = 4096, 8
    scb = torch.rand(n, generator=gen) * 10 + 0.01
    recip = scb * torch.tensor(1 / 127, dtype=torch.float32)
    assert (recip != scb / torch.full_like(scb, 127.0)).any()  # the test can tell them apart
    cb = torch.full((n, k), 127, dtype=torch.int8)
    deq = dequant_int8_rowwise(cb, scb)
    buf = torch.empty(n * k, device=DEVICE)
    slab = int8_decoder(cb.to(DEVICE), scb.to(DEVICE))(buf, 0, n, 0, k)
    assert torch.equal(slab.cpu(), deq)


@pytest.mark.parametrize(
    "total,other,slab,align,want",
    [
        (14336, 4096, 32 * 2**20, 128, 3584),  # 3.5 bands of 4096 rows -> 4 bands of 3584
        (13824, 5120, 32 * 2**20, 128, 2816),  # at most 3200 rows -> 5 bands: 4 × 2816 + 2560
        (4096, 14336, 32 * 2**20, 64, 1024),  # 1152 columns fit -> 4 bands of 1024
        (300, 64, 1, 128, 128),  # the alignment floor
        (300, 64, 10**9, 128, 300),  # one band
    ],
)
def test_bands_are_balanced_and_fit_the_slab(total, other, slab, align, want):
    band = _band(total, other, 2, slab, align)
    assert band == want
    assert band * other * 2 <= max(slab, align * other * 2)


# slab_bytes small enough that every call streams several bands, the last one partial
@pytest.mark.parametrize("m,n,k", [(1, 300, 64), (33, 130, 192), (5, 257, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_int8_forward_and_dx(m, n, k, dtype, gen):
    dec, deq = _int8(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    g = torch.randn(m, n, generator=gen).to(dtype)
    slab = 64 * k * x.element_size()  # forward bands of 128 rows (the alignment floor)
    y = streamed_matmul_nt(x.to(DEVICE), dec, n, k, slab_bytes=slab)
    dx = streamed_matmul_nn(g.to(DEVICE), dec, n, k, slab_bytes=64 * n * g.element_size())
    assert y.shape == (m, n) and dx.shape == (m, k) and y.dtype == dx.dtype == dtype
    w = deq.to(dtype).double()
    assert _rel(y, x.double() @ w.t()) <= TOL[dtype]
    assert _rel(dx, g.double() @ w) <= TOL[dtype]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_streamed_4bit_forward_and_dx(quant_type, gen):
    n, k = 131, 256
    dec, deq = _4bit(n, k, quant_type, True, gen)
    x = torch.randn(2, 3, k, generator=gen)  # leading dims are kept
    g = torch.randn(2, 3, n, generator=gen)
    y = streamed_matmul_nt(x.to(DEVICE), dec, n, k, slab_bytes=1)  # 128-row bands
    dx = streamed_matmul_nn(g.to(DEVICE), dec, n, k, slab_bytes=1)  # 64-column bands
    assert y.shape == (2, 3, n) and dx.shape == (2, 3, k)
    assert _rel(y, x.double() @ deq.double().t()) <= TOL[torch.float32]
    assert _rel(dx, g.double() @ deq.double()) <= TOL[torch.float32]


def test_errors(gen):
    dec, _ = _int8(8, 16, gen)
    with pytest.raises(ValueError, match="last dim 8; the weight \\[8, 16\\] needs 16"):
        streamed_matmul_nt(torch.randn(2, 8, device=DEVICE), dec, 8, 16)
    with pytest.raises(ValueError, match="last dim 16; the weight \\[8, 16\\] needs 8"):
        streamed_matmul_nn(torch.randn(2, 16, device=DEVICE), dec, 8, 16)
    with pytest.raises(ValueError, match="lut must be 'gather' or 'select'"):
        fourbit_decoder(torch.zeros(8, dtype=torch.uint8), torch.ones(1), torch.ones(16), 64, 16,
                        lut="table")  # fmt: skip
    with pytest.raises(ValueError, match="slab_bytes must be positive"):
        streamed_matmul_nt(torch.randn(2, 16, device=DEVICE), dec, 8, 16, slab_bytes=0)
    assert streamed_matmul_nt(torch.randn(0, 16, device=DEVICE), dec, 8, 16).shape == (0, 8)


@pytest.mark.parametrize("slab_bytes", [1, 40 * 64 * 4])  # one band of 128 rows / several bands
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_feature_major_gemms_equal_the_float64_products(slab_bytes, fmt, gen):
    """``W @ zt`` and ``Wᵀ @ dht`` with feature-major operands [dim, T] (the layout of a layer
    that keeps its activations feature-major), ragged bands, against float64 products of the same
    rounded weight."""
    n, k, t = 300, 128, 37
    dec, deq = _int8(n, k, gen) if fmt == "int8" else _4bit(n, k, "nf4", False, gen)
    zt = torch.randn(k, t, generator=gen)
    dht = torch.randn(n, t, generator=gen)
    ht = streamed_matmul_fm(zt.to(DEVICE), dec, n, k, slab_bytes=slab_bytes)
    assert ht.shape == (n, t) and ht.is_contiguous()
    assert _rel(ht, deq.double() @ zt.double()) < TOL[torch.float32]
    dzt = streamed_matmul_t_fm(dht.to(DEVICE), dec, n, k, slab_bytes=slab_bytes)
    assert dzt.shape == (k, t) and dzt.is_contiguous()
    assert _rel(dzt, deq.double().t() @ dht.double()) < TOL[torch.float32]
    with pytest.raises(ValueError, match=r"zt must be \[k, T\] with k = 128"):
        streamed_matmul_fm(zt.t().contiguous().to(DEVICE), dec, n, k)


@pytest.mark.parametrize("slab_bytes", [1, 10**9])  # bands of 128 rows / one band
@pytest.mark.parametrize("row_align", [16, 256])
def test_one_decode_backward_equals_the_two_float64_products(slab_bytes, row_align, gen):
    """streamed_backward_fm: the recompute W @ zt reaches on_rows band by band (whole groups of
    row_align rows, a ragged last band) and the dX GEMM Wᵀ @ dht is summed over the bands."""
    from quant_kernels.streamed import streamed_backward_fm

    n, k, t = 304, 64, 9  # 304 = 2·128 + 48 rows
    dec, deq = _int8(n, k, gen)
    zt, dht = torch.randn(k, t, generator=gen), torch.randn(n, t, generator=gen)
    got = torch.full((n, t), float("nan"))
    seen = []

    def on_rows(row0, rows):
        seen.append((row0, rows.shape[0]))
        got[row0 : row0 + rows.shape[0]] = rows.cpu()

    dzt = streamed_backward_fm(zt.to(DEVICE), dht.to(DEVICE), dec, n, k, row_align=row_align,
                               on_rows=on_rows, slab_bytes=slab_bytes)  # fmt: skip
    band = n if slab_bytes > 1 else max(128, row_align)
    assert seen == [(r, min(band, n - r)) for r in range(0, n, band)]
    assert _rel(got, deq.double() @ zt.double()) < TOL[torch.float32]
    assert dzt.shape == (k, t) and dzt.is_contiguous()
    assert _rel(dzt, deq.double().t() @ dht.double()) < TOL[torch.float32]
    with pytest.raises(ValueError, match=r"dht \[n, T\] = \[304, T\]"):
        streamed_backward_fm(zt.to(DEVICE), dht[:-1].to(DEVICE), dec, n, k, row_align=16,
                             on_rows=on_rows)  # fmt: skip
    with pytest.raises(ValueError, match="row_align must be >= 1"):
        streamed_backward_fm(zt.to(DEVICE), dht.to(DEVICE), dec, n, k, row_align=0,
                             on_rows=on_rows)  # fmt: skip
