"""The plain-torch int8 × int8 GEMMs (quant_kernels.reference_int8_mma) against a float64 dense
product of the stored weight, within the derived bound, and the bound against the error."""

import math

import pytest
import torch

from quant_kernels.reference import quantize_int8_rowwise
from quant_kernels.reference_int8_mma import (
    MAX_REDUCTION,
    int8_mma_error_bound,
    int8_mma_matmul,
    int8_mma_matmul_t,
    int_matmul,
    quantize_rows,
)


def _weight(n: int, k: int, gen: torch.Generator):
    """int8 codes of a Gaussian weight and the float64 dense ``CB · SCB / 127`` (independent of
    the code under test: the division in float64)."""
    cb, scb = quantize_int8_rowwise(torch.randn(n, k, generator=gen))
    return cb, scb, cb.double() * (scb.double() / 127)[:, None]


def test_int_matmul_is_exact():
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (33, 70), generator=gen, dtype=torch.int8)
    b = torch.randint(-127, 128, (50, 70), generator=gen, dtype=torch.int8)
    got = int_matmul(a, b.t())  # a transposed view, as the forward reads CB
    assert got.dtype == torch.int32
    assert torch.equal(got.long(), a.long() @ b.long().t())
    # the largest products over a long reduction: still exact in int32
    k = 14336
    worst = int_matmul(torch.full((2, k), -127, dtype=torch.int8),
                       torch.full((k, 3), 127, dtype=torch.int8))  # fmt: skip
    assert (worst == -127 * 127 * k).all()
    assert int_matmul(a[:0], b.t()).shape == (0, 50)


def test_int_matmul_refuses_overflowing_reductions():
    with pytest.raises(ValueError, match="overflow"):
        int_matmul(torch.zeros(1, MAX_REDUCTION + 1, dtype=torch.int8),
                   torch.zeros(MAX_REDUCTION + 1, 1, dtype=torch.int8))  # fmt: skip
    with pytest.raises(ValueError, match="int8"):
        int_matmul(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.int8))


def test_quantize_rows_round_to_nearest():
    a = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -3.0, 0.1]])
    q, s = quantize_rows(a)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert torch.equal(s, torch.tensor([1 / 127, 0.0, 3 / 127]))
    # 127 · 0.25 = 31.75 → 32; 127 · 0.5 = 63.5 → 64 (half to even); 127 · 0.1 / 3 = 4.23 → 4
    assert q.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0], [127, 64, -127, 4]]
    # each element within half a step of its code
    err = (a - q.float() * s[:, None]).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-6)).all()


def test_quantize_rows_non_finite_rows_give_non_finite_scales():
    a = torch.tensor([[1.0, float("nan")], [float("inf"), 1.0], [1.0, 2.0]])
    q, s = quantize_rows(a)
    assert math.isnan(s[0]) and math.isinf(s[1]) and s[2] == 2 / 127
    assert q[:2].eq(0).all()
    y = int8_mma_matmul(a, torch.ones(3, 2, dtype=torch.int8), torch.ones(3))
    assert not y[:2].isfinite().any() and y[2].isfinite().all()


@pytest.mark.parametrize("m,k,n", [(33, 64, 48), (7, 257, 130), (1, 16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_within_the_derived_bound(m, k, n, dtype):
    gen = torch.Generator().manual_seed(m * k + n)
    cb, scb, w = _weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    h = int8_mma_matmul(x, cb, scb)
    assert h.shape == (m, n) and h.dtype == dtype
    err = (h.double() - x.double() @ w.t()).abs()
    bound = int8_mma_error_bound(x, cb, scb, out_dtype=dtype)
    assert (err <= bound).all()
    assert err.max() > 0  # the activation really was quantized
    if m * n >= 100:  # not vacuous: the worst element reaches a fair share of its bound
        assert (err / bound).max() > 0.05


@pytest.mark.parametrize("m,k,n", [(33, 64, 48), (7, 257, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dx_within_the_derived_bound(m, k, n, dtype):
    gen = torch.Generator().manual_seed(m * k + n + 1)
    cb, scb, w = _weight(n, k, gen)
    g = torch.randn(m, n, generator=gen).to(dtype)
    dz = int8_mma_matmul_t(g, cb, scb)
    assert dz.shape == (m, k) and dz.dtype == dtype
    err = (dz.double() - g.double() @ w).abs()
    bound = int8_mma_error_bound(g, cb, scb, weight_t=True, out_dtype=dtype)
    assert (err <= bound).all()
    assert (err / bound).max() > 0.05


def test_typical_error_matches_the_rounding_model():
    # round-to-nearest errors are ~uniform in ±s/2: the rms error of h[m, n] is s_m/√12 · ‖w_n‖₂
    gen = torch.Generator().manual_seed(7)
    cb, scb, w = _weight(96, 512, gen)
    x = torch.randn(256, 512, generator=gen)
    err = int8_mma_matmul(x, cb, scb).double() - x.double() @ w.t()
    _, s = quantize_rows(x)
    model = s.double()[:, None] / math.sqrt(12) * w.norm(dim=1)[None, :]
    ratio = (err.pow(2).mean() / model.pow(2).mean()).sqrt().item()
    assert 0.8 < ratio < 1.25


def test_leading_dims_and_out_dtype():
    gen = torch.Generator().manual_seed(3)
    cb, scb, w = _weight(24, 40, gen)
    x = torch.randn(2, 3, 80, generator=gen)[..., ::2]  # non-contiguous rows
    h = int8_mma_matmul(x, cb, scb, out_dtype=torch.bfloat16)
    assert h.shape == (2, 3, 24) and h.dtype == torch.bfloat16
    x2 = x.reshape(6, 40)
    err = (h.double().view(6, 24) - x2.double() @ w.t()).abs()
    assert (err <= int8_mma_error_bound(x2, cb, scb, out_dtype=torch.bfloat16)).all()
    with pytest.raises(ValueError, match="last dim"):
        int8_mma_matmul(torch.randn(2, 8), cb, scb)
    with pytest.raises(ValueError, match="last dim"):
        int8_mma_matmul_t(torch.randn(2, 40), cb, scb)
    with pytest.raises(ValueError, match="int8"):
        int8_mma_matmul(torch.randn(2, 40), cb.float(), scb)


def test_stochastic_dx_is_unbiased():
    """The mean of many stochastically rounded dX GEMMs converges to the exact product (every
    element inside a 5σ interval of its sample mean), while round-to-nearest's fixed error
    lies outside that interval for many elements (so the test can tell the two apart)."""
    gen = torch.Generator().manual_seed(11)
    cb, scb, w = _weight(32, 24, gen)
    g = torch.randn(6, 32, generator=gen)
    exact = g.double() @ w
    draws = 4000
    rng = torch.Generator().manual_seed(12)
    samples = torch.stack([
        int8_mma_matmul_t(g, cb, scb, stochastic=True, generator=rng).double()
        for _ in range(draws)
    ])  # fmt: skip
    sem = samples.std(dim=0) / math.sqrt(draws)
    z_sr = (samples.mean(dim=0) - exact).abs() / sem
    assert z_sr.max() < 5
    z_rtn = (int8_mma_matmul_t(g, cb, scb).double() - exact).abs() / sem
    assert (z_rtn > 5).float().mean() > 0.5
    # each draw stays within its (one-step) stochastic bound
    bound = int8_mma_error_bound(g, cb, scb, weight_t=True, stochastic=True)
    assert ((samples - exact).abs() <= bound).all()


def test_stochastic_rounding_is_seeded():
    gen = torch.Generator().manual_seed(5)
    cb, scb, _ = _weight(16, 8, gen)
    g = torch.randn(4, 16, generator=gen)
    one = int8_mma_matmul_t(g, cb, scb, stochastic=True,
                            generator=torch.Generator().manual_seed(1))  # fmt: skip
    same = int8_mma_matmul_t(g, cb, scb, stochastic=True,
                             generator=torch.Generator().manual_seed(1))  # fmt: skip
    other = int8_mma_matmul_t(g, cb, scb, stochastic=True,
                              generator=torch.Generator().manual_seed(2))  # fmt: skip
    assert torch.equal(one, same) and not torch.equal(one, other)


def test_int8_rowwise_format_takes_the_int8_path_when_the_policy_says_so():
    from quant_kernels.formats import Int8Rowwise
    from quant_kernels.policy import KernelPolicy

    gen = torch.Generator().manual_seed(9)
    cb, scb, _ = _weight(24, 40, gen)
    fmt = Int8Rowwise(cb, scb)
    x, g = torch.randn(6, 40, generator=gen), torch.randn(6, 24, generator=gen)
    int8 = KernelPolicy(w0_gemm="int8", triton=False)
    assert torch.equal(fmt.matmul(x, kernels=int8), int8_mma_matmul(x, cb, scb))
    assert torch.equal(fmt.matmul_t(g, kernels=int8), int8_mma_matmul_t(g, cb, scb))
    ht = fmt.matmul_fm(x.t().contiguous(), kernels=int8)
    assert ht.is_contiguous() and torch.equal(ht, int8_mma_matmul(x, cb, scb).t())
    dzt = fmt.matmul_t_fm(g.t().contiguous(), kernels=int8)
    assert dzt.is_contiguous() and torch.equal(dzt, int8_mma_matmul_t(g, cb, scb).t())
    rows = []
    dzt2 = fmt.backward_fm(x.t().contiguous(), g.t().contiguous(), 8,
                           lambda r0, h: rows.append((r0, h)), kernels=int8)  # fmt: skip
    assert torch.equal(dzt2, dzt) and rows[0][0] == 0 and torch.equal(rows[0][1], ht)
    # the default policy keeps the dequant reference (not the int8 product)
    assert not torch.equal(fmt.matmul(x), int8_mma_matmul(x, cb, scb))
    sr = KernelPolicy(w0_gemm="int8", triton=False, int8_dx_rounding="stochastic")
    torch.manual_seed(0)
    one = fmt.matmul_t(g, kernels=sr)
    assert not torch.equal(one, fmt.matmul_t(g, kernels=int8))
    torch.manual_seed(0)
    assert torch.equal(one, fmt.matmul_t(g, kernels=sr))  # seeded by torch's global RNG
