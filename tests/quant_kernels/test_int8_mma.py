"""The Triton int8 × int8 GEMMs (quant_kernels.int8_mma) against the plain-torch oracle
(quant_kernels.reference_int8_mma) and a float64 dense product (CPU: Triton interpreter).

Integer accumulation is exact, so the codes, scales and outputs equal the oracle's; on a GPU the
outputs may differ from it by one rounding of the fp32 epilogue."""

import math
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs a GPU or TRITON_INTERPRET=1 (set by tests/conftest.py)", allow_module_level=True
    )

from quant_kernels import int8_mma
from quant_kernels import reference_int8_mma as ref
from quant_kernels.reference import int8_row_scale, quantize_int8_rowwise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# odd shapes, none a multiple of the interpreter's 16 × 16 × 32 tiles but the last
SHAPES = [(1, 17, 9), (33, 40, 50), (5, 3, 130), (64, 64, 32)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _weight(n: int, k: int, gen: torch.Generator):
    cb, scb = quantize_int8_rowwise(torch.randn(n, k, generator=gen))
    return cb.to(DEVICE), scb.to(DEVICE), cb.double() * (scb.double() / 127)[:, None]


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal on the CPU; within one rounding of the output dtype on a GPU."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        eps = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got, want, rtol=eps, atol=eps * want.abs().max().item())


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_equals_the_oracle(m, k, n, dtype, gen):
    a = (torch.randn(m, k, generator=gen) * 3).to(dtype).to(DEVICE)
    scale = torch.rand(k, generator=gen).to(DEVICE) + 0.5
    for col_scale in (None, scale):
        q, s = int8_mma.quantize_rows(a, col_scale=col_scale)
        q0, s0 = ref.quantize_rows(a, col_scale=col_scale)
        assert q.is_contiguous() and torch.equal(q, q0) and torch.equal(s, s0)
    # a feature-major activation: its rows are the columns of a [K, T] tensor
    at = torch.randn(k, m, generator=gen).to(dtype).to(DEVICE)
    q, s = int8_mma.quantize_rows(at.t())
    q0, s0 = ref.quantize_rows(at.t())
    assert torch.equal(q, q0) and torch.equal(s, s0)


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_equals_the_oracle_and_keeps_the_bound(m, k, n, dtype, gen):
    cb, scb, w = _weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    h = int8_mma.int8_mma_matmul(x, cb, scb)
    _same(h, ref.int8_mma_matmul(x, cb, scb))
    err = (h.double().cpu() - x.double().cpu() @ w.t()).abs()
    assert (err <= ref.int8_mma_error_bound(x, cb, scb, out_dtype=dtype).cpu()).all()


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dx_equals_the_oracle_and_keeps_the_bound(m, k, n, dtype, gen):
    cb, scb, w = _weight(n, k, gen)
    g = torch.randn(m, n, generator=gen).to(dtype).to(DEVICE)
    dz = int8_mma.int8_mma_matmul_t(g, cb, scb)
    _same(dz, ref.int8_mma_matmul_t(g, cb, scb))
    err = (dz.double().cpu() - g.double().cpu() @ w).abs()
    bound = ref.int8_mma_error_bound(g, cb, scb, weight_t=True, out_dtype=dtype).cpu()
    assert (err <= bound).all()


def test_feature_major_in_and_out(gen):
    cb, scb, _ = _weight(50, 40, gen)
    zt = torch.randn(40, 33, generator=gen, device="cpu").to(DEVICE)  # [K, T]
    ht = int8_mma.int8_mma_matmul(zt.t(), cb, scb, feature_major_out=True)
    assert ht.shape == (50, 33) and ht.is_contiguous()
    _same(ht, ref.int8_mma_matmul(zt.t(), cb, scb).t().contiguous())
    dht = torch.randn(50, 33, generator=gen).to(DEVICE)
    dzt = int8_mma.int8_mma_matmul_t(dht.t(), cb, scb, feature_major_out=True)
    assert dzt.shape == (40, 33) and dzt.is_contiguous()
    _same(dzt, ref.int8_mma_matmul_t(dht.t(), cb, scb).t().contiguous())


def test_leading_dims_and_out_dtype(gen):
    cb, scb, _ = _weight(24, 40, gen)
    x = torch.randn(2, 3, 40, generator=gen).to(DEVICE)
    h = int8_mma.int8_mma_matmul(x, cb, scb, out_dtype=torch.bfloat16)
    assert h.shape == (2, 3, 24) and h.dtype == torch.bfloat16
    _same(h, ref.int8_mma_matmul(x, cb, scb, out_dtype=torch.bfloat16))
    g = torch.randn(2, 3, 24, generator=gen).to(DEVICE)
    _same(int8_mma.int8_mma_matmul_t(g, cb, scb), ref.int8_mma_matmul_t(g, cb, scb))


def test_non_finite_rows_stay_non_finite(gen):
    cb, scb, _ = _weight(20, 36, gen)
    x = torch.randn(6, 36, generator=gen)
    x[1, 7], x[3, 0] = float("nan"), float("-inf")
    h = int8_mma.int8_mma_matmul(x.to(DEVICE), cb, scb).cpu()
    assert h[1].isnan().all() and not h[3].isfinite().any()
    keep = [0, 2, 4, 5]
    assert h[keep].isfinite().all()
    _same(h[keep].to(DEVICE), ref.int8_mma_matmul(x[keep].to(DEVICE), cb, scb))


def test_stochastic_codes_are_a_neighbour_and_unbiased():
    gen = torch.Generator().manual_seed(21)
    cb, scb, w = _weight(32, 24, gen)
    g = torch.randn(6, 32, generator=gen).to(DEVICE)
    ws = int8_row_scale(scb)
    # each code is the floor or the ceiling of the scaled value
    q, s = int8_mma.quantize_rows(g, col_scale=ws, stochastic=True)
    _, s_rtn = ref.quantize_rows(g, col_scale=ws)
    assert torch.equal(s, s_rtn)
    scaled = (g.float() * ws[None, :]) / s_rtn[:, None]
    assert ((q.float() - scaled).abs() < 1 + 1e-4).all()
    # the mean of many draws of the dX GEMM converges to the exact product; the draws are the
    # rows of one call on the rows repeated (each row and column gets its own Philox noise)
    exact = g.double().cpu() @ w
    draws = 256
    samples = int8_mma.int8_mma_matmul_t(g.repeat(draws, 1), cb, scb, stochastic=True)
    samples = samples.double().cpu().view(draws, *exact.shape)
    sem = samples.std(dim=0) / math.sqrt(draws)
    assert ((samples.mean(dim=0) - exact).abs() / sem).max() < 5
    z_rtn = (int8_mma.int8_mma_matmul_t(g, cb, scb).double().cpu() - exact).abs() / sem
    assert (z_rtn > 5).float().mean() > 0.2, (z_rtn > 5).float().mean()  # RTN's fixed error


def test_stochastic_rounding_follows_its_generator(gen):
    cb, scb, _ = _weight(16, 40, gen)
    g = torch.randn(4, 16, generator=gen).to(DEVICE)

    def run(seed: int) -> torch.Tensor:
        rng = torch.Generator(device=DEVICE).manual_seed(seed)
        return int8_mma.int8_mma_matmul_t(g, cb, scb, stochastic=True, generator=rng)

    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))


def test_shape_errors(gen):
    cb, scb, _ = _weight(8, 16, gen)
    with pytest.raises(ValueError, match="last dim"):
        int8_mma.int8_mma_matmul(torch.randn(2, 8, device=DEVICE), cb, scb)
    with pytest.raises(ValueError, match="last dim"):
        int8_mma.int8_mma_matmul_t(torch.randn(2, 16, device=DEVICE), cb, scb)
    with pytest.raises(ValueError, match="int8"):
        int8_mma.int8_mma_matmul(torch.randn(2, 16, device=DEVICE), cb.float(), scb)
    with pytest.raises(ValueError, match="2-D"):
        int8_mma.int8_mma_matmul(torch.randn(1, 2, 16, device=DEVICE), cb, scb,
                                 feature_major_out=True)  # fmt: skip


def test_int8_rowwise_format_runs_the_kernels_under_its_policy(gen, monkeypatch):
    from quant_kernels.formats import Int8Rowwise
    from quant_kernels.policy import KernelPolicy

    cb, scb, _ = _weight(24, 40, gen)
    fmt = Int8Rowwise(cb, scb)
    pol = KernelPolicy(w0_gemm="int8", interpret_on_cpu=True)
    x = torch.randn(6, 40, generator=gen).to(DEVICE)
    g = torch.randn(6, 24, generator=gen).to(DEVICE)
    calls = []
    real = int8_mma.int8_mma_matmul

    def spy(*args, **kwargs):
        calls.append(kwargs.get("feature_major_out", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(int8_mma, "int8_mma_matmul", spy)
    _same(fmt.matmul(x, kernels=pol), ref.int8_mma_matmul(x, cb, scb))
    _same(fmt.matmul_fm(x.t().contiguous(), kernels=pol),
          ref.int8_mma_matmul(x, cb, scb).t().contiguous())  # fmt: skip
    assert calls == [False, True]
    _same(fmt.matmul_t(g, kernels=pol), ref.int8_mma_matmul_t(g, cb, scb))
    _same(fmt.matmul_t_fm(g.t().contiguous(), kernels=pol),
          ref.int8_mma_matmul_t(g, cb, scb).t().contiguous())  # fmt: skip
