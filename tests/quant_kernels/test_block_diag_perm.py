"""Permutation-fused block-diagonal kernels vs gather + pad + block matmul (Triton interpreter)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs a GPU or TRITON_INTERPRET=1 (set by tests/conftest.py)", allow_module_level=True
    )

from quant_kernels.block_diag_perm import block_diag_perm_grad, block_diag_perm_matmul
from quant_kernels.reference import block_diag_matmul, permute_last

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _dev(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE)


def _padded(x: torch.Tensor, nb: int, b: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, nb * b - x.shape[-1]))


def _reference(x, g, in_perm, out_perm, transpose_g):
    """gather → zero-pad → x @ BD(G)ᵀ → slice → scatter, in float64."""
    nb, b, _ = g.shape
    dim = x.shape[-1]
    x = x.double()
    if in_perm is not None:
        x = permute_last(x, in_perm)
    gg = g.double().transpose(1, 2) if transpose_g else g.double()
    r = block_diag_matmul(_padded(x, nb, b), gg)[..., :dim]
    if out_perm is not None:
        r = permute_last(r, torch.argsort(out_perm))  # out[..., out_perm[j]] = r[..., j]
    return r


# dim a multiple of b, and ragged (dim = 3·b − 7 with a partial last block); b = 16 and 32 with a
# tile of 16; T not a multiple of the token tile
@pytest.mark.parametrize("dim,b", [(48, 16), (57, 32), (25, 16)])
@pytest.mark.parametrize("in_p,out_p,tr", [(True, False, False), (False, True, False),
                                           (True, True, True), (False, False, True)])  # fmt: skip
def test_matmul_equals_gather_blockdiag_scatter(dim, b, in_p, out_p, tr, gen):
    nb = -(-dim // b)
    x = torch.randn(3, 7, dim, generator=gen)
    g = torch.randn(nb, b, b, generator=gen)
    in_perm = torch.randperm(dim, generator=gen) if in_p else None
    out_perm = torch.randperm(dim, generator=gen) if out_p else None
    out = block_diag_perm_matmul(x.to(DEVICE), g.to(DEVICE), in_perm=_dev(in_perm),
                                 out_perm=_dev(out_perm), transpose_g=tr)  # fmt: skip
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = _reference(x, g, in_perm, out_perm, tr)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5)


def test_bf16_rounds_once_from_fp32_accumulation(gen):
    dim, b = 64, 32
    x = torch.randn(20, dim, generator=gen).bfloat16()
    g = torch.randn(2, b, b, generator=gen).bfloat16()
    perm = torch.randperm(dim, generator=gen)
    out = block_diag_perm_matmul(x.to(DEVICE), g.to(DEVICE), in_perm=perm.to(DEVICE))
    ref = _reference(x, g, perm, None, False)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("dim,b", [(48, 16), (57, 32)])
@pytest.mark.parametrize("a_p,v_p", [(True, True), (False, True), (False, False)])
def test_grad_equals_blockwise_outer_products(dim, b, a_p, v_p, gen):
    nb = -(-dim // b)
    a = torch.randn(37, dim, generator=gen)
    v = torch.randn(37, dim, generator=gen)
    a_perm = torch.randperm(dim, generator=gen) if a_p else None
    v_perm = torch.randperm(dim, generator=gen) if v_p else None
    dg = block_diag_perm_grad(a.to(DEVICE), v.to(DEVICE), nb, b, a_perm=_dev(a_perm),
                              v_perm=_dev(v_perm))  # fmt: skip
    ap = _padded(a.double() if a_perm is None else permute_last(a.double(), a_perm), nb, b)
    vp = _padded(v.double() if v_perm is None else permute_last(v.double(), v_perm), nb, b)
    ref = torch.einsum("tkd,tkc->kdc", ap.view(37, nb, b), vp.view(37, nb, b))
    torch.testing.assert_close(dg.cpu().double(), ref, rtol=1e-5, atol=1e-5)
    # it is the autograd gradient of out = v' @ BD(G)ᵀ with upstream gradient a'
    g = torch.zeros(nb, b, b, dtype=torch.float64, requires_grad=True)
    block_diag_matmul(vp, g).backward(ap)
    torch.testing.assert_close(dg.cpu().double(), g.grad, rtol=1e-5, atol=1e-5)


def test_errors(gen):
    x = torch.zeros(2, 40, device=DEVICE)
    with pytest.raises(ValueError, match="do not cover dim 40"):
        block_diag_perm_matmul(x, torch.zeros(2, 16, 16, device=DEVICE))
    with pytest.raises(ValueError, match="in_perm must be 1-D of length 40"):
        block_diag_perm_matmul(x, torch.zeros(3, 16, 16, device=DEVICE),
                               in_perm=torch.arange(39, device=DEVICE))  # fmt: skip
    with pytest.raises(ValueError, match="must have the same shape"):
        block_diag_perm_grad(x, torch.zeros(3, 40, device=DEVICE), 3, 16)
