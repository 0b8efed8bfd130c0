"""Fused Triton CNP (forward + hand-derived backward) vs the torch reference (CPU: interpreter).

Under ``TRITON_INTERPRET=1`` (set by tests/conftest.py when there is no GPU) the kernels use
16×16 tiles, so b = 8 (one partial tile), 16 (one full tile), 20 (a full and a partial tile), 32
(2×2 tiles) and 40 (3×3 tiles, the last partial: every piece of the diagonal-split K loops runs)
exercise every masking case; b = 40 also runs with 32×32 tiles, the fp32 GPU default.
"""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs a GPU or TRITON_INTERPRET=1 (set by tests/conftest.py)", allow_module_level=True
    )

from quant_kernels.cnp_triton import (
    cayley_neumann_fused,
    cnp_backward,
    cnp_forward,
)
from quant_kernels.reference import cayley_neumann, skew_from_packed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# max abs error vs float64 (fp32); relative Frobenius error vs float64 (16-bit: Triton's CPU
# interpreter truncates fp32 -> bf16 instead of rounding, hence the looser bf16 bound there)
FP32_ATOL = 1e-5 if DEVICE == "cpu" else 5e-5
REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
SIZES = [(8, 3, None), (16, 2, None), (20, 2, None), (32, 1, None), (40, 1, None), (40, 1, (32, 4))]


def _packed(nb: int, b: int, gen: torch.Generator, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(nb, b * (b - 1) // 2, generator=gen) * (scale / b**0.5)


def _ref_grad(packed: torch.Tensor, d_g: torch.Tensor, b: int) -> torch.Tensor:
    leaf = packed.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(cayley_neumann(leaf, b, 3), leaf, d_g)
    return grad


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("b,nb,config", SIZES)
def test_fp32_forward_and_backward_match_reference(b, nb, config, gen):
    packed = _packed(nb, b, gen)
    d_g = torch.randn(nb, b, b, generator=gen)
    g = cnp_forward(packed.to(DEVICE), b, config=config)
    d_packed = cnp_backward(packed.to(DEVICE), d_g.to(DEVICE), b, config=config)
    assert g.shape == (nb, b, b) and g.dtype == torch.float32
    assert d_packed.shape == packed.shape and d_packed.dtype == torch.float32
    g64 = cayley_neumann(packed.double(), b, 3)
    assert (g.double().cpu() - g64).abs().max().item() <= FP32_ATOL
    grad64 = _ref_grad(packed.double(), d_g.double(), b)
    grad32 = _ref_grad(packed, d_g, b)  # torch autograd of the reference, fp32
    assert (d_packed.double().cpu() - grad64).abs().max().item() <= FP32_ATOL
    assert (d_packed.cpu() - grad32).abs().max().item() <= FP32_ATOL


# the GPU-only rows run the default 16-bit configuration at real block sizes (128-wide tiles,
# whole and partial); the interpreter would take minutes there
_GPU_ONLY = pytest.mark.skipif(DEVICE == "cpu", reason="real block sizes: GPU only")
SIZES_16BIT = [(16, 2), (20, 1), pytest.param(256, 3, marks=_GPU_ONLY),
               pytest.param(200, 2, marks=_GPU_ONLY)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,nb", SIZES_16BIT)
def test_16bit_forward_and_backward_match_reference(b, nb, dtype, gen):
    packed = _packed(nb, b, gen).to(dtype)
    d_g = torch.randn(nb, b, b, generator=gen).to(dtype)
    g = cnp_forward(packed.to(DEVICE), b)
    d_packed = cnp_backward(packed.to(DEVICE), d_g.to(DEVICE), b)
    assert g.dtype == dtype and d_packed.dtype == dtype
    # truth: float64 on the same (rounded) inputs
    assert _rel(g, cayley_neumann(packed.double(), b, 3)) <= REL_TOL[dtype]
    assert _rel(d_packed, _ref_grad(packed.double(), d_g.double(), b)) <= REL_TOL[dtype]


@pytest.mark.parametrize("scale", [0.15, 0.05])
def test_orthogonal_to_fourth_order(scale, gen):
    b = 16
    packed = _packed(2, b, gen, scale=scale)  # ‖Q‖₂ ≈ 2·scale
    g = cnp_forward(packed.to(DEVICE), b).double().cpu()
    norm_q = torch.linalg.matrix_norm(skew_from_packed(packed.double(), b), ord=2).max().item()
    err = torch.linalg.matrix_norm(g.transpose(1, 2) @ g - torch.eye(b), ord=2).max().item()
    # (I+Q)(I+Q+Q²+Q³) = Cayley(Q) − (I+Q)Q⁴(I−Q)⁻¹: GᵀG − I = O(‖Q‖⁴) for small Q
    assert norm_q < 0.5
    assert err <= 4 * norm_q**4 + 1e-6
    assert err >= 0.1 * norm_q**4  # the truncation error is really there (the check has teeth)


def test_autograd_function_saves_only_packed_and_matches_reference(gen):
    b = 16
    packed = _packed(2, b, gen).to(DEVICE).requires_grad_(True)
    d_g = torch.randn(2, b, b, generator=gen).to(DEVICE)
    g = cayley_neumann_fused(packed, b)
    saved = g.grad_fn.saved_tensors
    assert len(saved) == 1 and saved[0].data_ptr() == packed.data_ptr()
    g.backward(d_g)
    ref = _ref_grad(packed.detach().cpu().double(), d_g.cpu().double(), b)
    assert (packed.grad.double().cpu() - ref).abs().max().item() <= FP32_ATOL
    with torch.no_grad():
        assert cayley_neumann_fused(packed, b).grad_fn is None


def test_zero_q_gives_identity_and_empty_stack():
    g = cnp_forward(torch.zeros(2, 28, device=DEVICE), 8)
    assert torch.equal(g.cpu(), torch.eye(8).expand(2, 8, 8))
    assert cnp_forward(torch.zeros(0, 28, device=DEVICE), 8).shape == (0, 8, 8)


def test_errors():
    p = torch.zeros(2, 28, device=DEVICE)
    with pytest.raises(ValueError, match="k = 3"):
        cayley_neumann_fused(p, 8, terms=4)
    with pytest.raises(ValueError, match="b\\(b-1\\)/2"):
        cnp_forward(p, 9)
    with pytest.raises(ValueError, match=">= 2"):
        cnp_forward(torch.zeros(2, 0, device=DEVICE), 1)
    with pytest.raises(ValueError, match="unsupported"):
        cnp_forward(p.double(), 8)
    with pytest.raises(ValueError, match="config"):
        cnp_forward(p, 8, config=(24, 4))
    with pytest.raises(ValueError, match="d_g"):
        cnp_backward(p, torch.zeros(2, 8, 9, device=DEVICE), 8)
