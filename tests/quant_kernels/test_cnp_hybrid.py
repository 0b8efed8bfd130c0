"""Fused Triton + cuBLAS CNP (:mod:`quant_kernels.cnp_hybrid`) vs float64 and the reference.

Under ``TRITON_INTERPRET=1`` the Triton kernels use 16×16 tiles and 16-wide K steps: b = 8 (one
partial tile), 16 (one full tile), 20 and 33 (full and partial tiles, partial last K step) and
40 (3×3 tiles) exercise every mask; b = 40 also runs 32×32 ``Q²`` tiles with 16-wide K steps.
"""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs a GPU or TRITON_INTERPRET=1 (set by tests/conftest.py)", allow_module_level=True
    )

from _cnp_cases import packed_blocks, reference_grad, run_and_check

from quant_kernels.cnp_hybrid import cayley_neumann_fused, cnp_backward_hybrid, cnp_forward_hybrid
from quant_kernels.reference import skew_from_packed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_ATOL = 1e-5 if DEVICE == "cpu" else 5e-5
REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
SIZES = [(8, 3, None), (16, 2, None), (20, 2, None), (33, 1, None), (40, 1, None),
         (40, 1, (32, 16, 4, 1))]  # fmt: skip
_GPU_ONLY = pytest.mark.skipif(DEVICE == "cpu", reason="real block sizes: GPU only")


@pytest.mark.parametrize("b,nb,config", SIZES)
def test_fp32_matches_float64_and_autograd_of_the_reference(b, nb, config, gen):
    packed, d_g, _, d_packed = run_and_check(
        cnp_forward_hybrid, cnp_backward_hybrid, nb, b, torch.float32, gen, DEVICE, FP32_ATOL,
        config,
    )  # fmt: skip
    grad32 = reference_grad(packed, d_g, b)  # torch autograd of the reference, fp32
    assert (d_packed.cpu() - grad32).abs().max().item() <= FP32_ATOL


SIZES_16BIT = [(16, 2), (20, 1), pytest.param(256, 3, marks=_GPU_ONLY),
               pytest.param(200, 2, marks=_GPU_ONLY)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,nb", SIZES_16BIT)
def test_16bit_matches_float64(b, nb, dtype, gen):
    run_and_check(
        cnp_forward_hybrid, cnp_backward_hybrid, nb, b, dtype, gen, DEVICE, REL_TOL[dtype]
    )


def test_hybrid_chunks_equal_one_chunk(gen):
    """Chunk boundaries change nothing: 7 blocks in chunks of 3 (the last one short) give the
    same ``G`` and gradient as one chunk — bit for bit on the CPU; on a GPU cuBLAS may pick
    another algorithm for another batch count, so there within fp32 rounding."""
    b, nb = 20, 7
    packed = packed_blocks(nb, b, gen).to(DEVICE)
    d_g = torch.randn(nb, b, b, generator=gen).to(DEVICE)
    three = 3 * b * b * packed.element_size()
    tol = {"rtol": 0.0, "atol": 0.0} if DEVICE == "cpu" else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(
        cnp_forward_hybrid(packed, b, chunk_bytes=three), cnp_forward_hybrid(packed, b), **tol
    )
    torch.testing.assert_close(
        cnp_backward_hybrid(packed, d_g, b, chunk_bytes=three),
        cnp_backward_hybrid(packed, d_g, b),
        **tol,
    )


def test_zero_q_gives_identity_and_empty_stack():
    fwd, bwd = cnp_forward_hybrid, cnp_backward_hybrid
    g = fwd(torch.zeros(2, 28, device=DEVICE), 8)
    assert torch.equal(g.cpu(), torch.eye(8).expand(2, 8, 8))
    assert fwd(torch.zeros(0, 28, device=DEVICE), 8).shape == (0, 8, 8)
    d_packed = bwd(torch.zeros(0, 28, device=DEVICE), torch.zeros(0, 8, 8, device=DEVICE), 8)
    assert d_packed.shape == (0, 28)


def test_errors():
    p = torch.zeros(2, 28, device=DEVICE)
    with pytest.raises(ValueError, match="k = 3"):
        cayley_neumann_fused(p, 8, terms=4)
    with pytest.raises(ValueError, match=">= 2"):
        cnp_forward_hybrid(torch.zeros(2, 0, device=DEVICE), 1)
    with pytest.raises(ValueError, match="unsupported"):
        cnp_forward_hybrid(p.double(), 8)
    with pytest.raises(ValueError, match="b\\(b-1\\)/2"):
        cnp_forward_hybrid(p, 9)
    with pytest.raises(ValueError, match="config"):
        cnp_forward_hybrid(p, 8, config=(24, 16, 4, 1))
    with pytest.raises(ValueError, match="d_g"):
        cnp_backward_hybrid(p, torch.zeros(2, 8, 9, device=DEVICE), 8)
    # a config of the wrong length, or stages < 1, named as such
    with pytest.raises(ValueError, match="takes \\(BM, BK, num_warps, num_stages\\)"):
        cayley_neumann_fused(p, 8, config=(16, 4))
    with pytest.raises(ValueError, match="stages an int >= 1"):
        cnp_forward_hybrid(p, 8, config=(16, 16, 4, 0))
    for bad in (0, -5, True, 2.5, None):
        with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
            cnp_forward_hybrid(p, 8, chunk_bytes=bad)


def test_hybrid_products_ignore_an_enclosing_autocast(gen):
    """The cuBLAS products inside run in ``packed.dtype`` even under autocast (which would
    otherwise run them in bf16 and mismatch the fp32 buffers): same result, bit for bit."""
    b = 20
    packed = packed_blocks(3, b, gen).to(DEVICE)
    d_g = torch.randn(3, b, b, generator=gen).to(DEVICE)
    plain = cnp_forward_hybrid(packed, b), cnp_backward_hybrid(packed, d_g, b)
    with torch.autocast(packed.device.type, dtype=torch.bfloat16):
        under = cnp_forward_hybrid(packed, b), cnp_backward_hybrid(packed, d_g, b)
    assert under[0].dtype == under[1].dtype == torch.float32
    assert torch.equal(under[0], plain[0]) and torch.equal(under[1], plain[1])


@pytest.mark.parametrize("scale", [0.15, 0.05])
def test_orthogonal_to_fourth_order(scale, gen):
    b = 16
    packed = packed_blocks(2, b, gen, scale=scale)  # ‖Q‖₂ ≈ 2·scale
    g = cnp_forward_hybrid(packed.to(DEVICE), b).double().cpu()
    norm_q = torch.linalg.matrix_norm(skew_from_packed(packed.double(), b), ord=2).max().item()
    err = torch.linalg.matrix_norm(g.transpose(1, 2) @ g - torch.eye(b), ord=2).max().item()
    # (I+Q)(I+Q+Q²+Q³) = Cayley(Q) − (I+Q)Q⁴(I−Q)⁻¹: GᵀG − I = O(‖Q‖⁴) for small Q
    assert norm_q < 0.5
    assert err <= 4 * norm_q**4 + 1e-6
    assert err >= 0.1 * norm_q**4  # the truncation error is really there (the check has teeth)


def test_autograd_function_saves_only_packed_and_matches_reference(gen):
    b = 16
    packed = packed_blocks(2, b, gen).to(DEVICE).requires_grad_(True)
    d_g = torch.randn(2, b, b, generator=gen).to(DEVICE)
    g = cayley_neumann_fused(packed, b)
    saved = g.grad_fn.saved_tensors
    assert len(saved) == 1 and saved[0].data_ptr() == packed.data_ptr()
    g.backward(d_g)
    ref = reference_grad(packed.detach().cpu().double(), d_g.cpu().double(), b)
    assert (packed.grad.double().cpu() - ref).abs().max().item() <= FP32_ATOL
    with torch.no_grad():
        again = cayley_neumann_fused(packed, b)
    assert again.grad_fn is None and torch.equal(again, g.detach())
