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

from _cnp_cases import packed_blocks, reference_grad, run_and_check

from quant_kernels.cnp_triton import (
    cayley_neumann_fused,
    cnp_backward,
    cnp_forward,
)
from quant_kernels.reference import skew_from_packed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# max abs error vs float64 (fp32); relative Frobenius error vs float64 (16-bit: Triton's CPU
# interpreter truncates fp32 -> bf16 instead of rounding, hence the looser bf16 bound there)
FP32_ATOL = 1e-5 if DEVICE == "cpu" else 5e-5
REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
SIZES = [(8, 3, None), (16, 2, None), (20, 2, None), (32, 1, None), (40, 1, None), (40, 1, (32, 4))]


@pytest.mark.parametrize("b,nb,config", SIZES)
def test_fp32_forward_and_backward_match_reference(b, nb, config, gen):
    packed, d_g, _, d_packed = run_and_check(
        cnp_forward, cnp_backward, nb, b, torch.float32, gen, DEVICE, FP32_ATOL, config
    )
    grad32 = reference_grad(packed, d_g, b)  # torch autograd of the reference, fp32
    assert (d_packed.cpu() - grad32).abs().max().item() <= FP32_ATOL


# the GPU-only rows run the default 16-bit configuration at real block sizes (128-wide tiles,
# whole and partial); the interpreter would take minutes there
_GPU_ONLY = pytest.mark.skipif(DEVICE == "cpu", reason="real block sizes: GPU only")
SIZES_16BIT = [(16, 2), (20, 1), pytest.param(256, 3, marks=_GPU_ONLY),
               pytest.param(200, 2, marks=_GPU_ONLY)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,nb", SIZES_16BIT)
def test_16bit_forward_and_backward_match_reference(b, nb, dtype, gen):
    # truth: float64 on the same (rounded) inputs
    run_and_check(cnp_forward, cnp_backward, nb, b, dtype, gen, DEVICE, REL_TOL[dtype])


@pytest.mark.parametrize("scale", [0.15, 0.05])
def test_orthogonal_to_fourth_order(scale, gen):
    b = 16
    packed = packed_blocks(2, b, gen, scale=scale)  # ‖Q‖₂ ≈ 2·scale
    g = cnp_forward(packed.to(DEVICE), b).double().cpu()
    norm_q = torch.linalg.matrix_norm(skew_from_packed(packed.double(), b), ord=2).max().item()
    err = torch.linalg.matrix_norm(g.transpose(1, 2) @ g - torch.eye(b), ord=2).max().item()
    # (I+Q)(I+Q+Q²+Q³) = Cayley(Q) − (I+Q)Q⁴(I−Q)⁻¹: GᵀG − I = O(‖Q‖⁴) for small Q
    assert norm_q < 0.5
    assert err <= 4 * norm_q**4 + 1e-6
    assert err >= 0.1 * norm_q**4  # the truncation error is really there (the check has teeth)


@pytest.mark.parametrize("layout", ["packed", "hybrid"])
def test_autograd_function_saves_only_packed_and_matches_reference(layout, gen):
    b = 16
    packed = packed_blocks(2, b, gen).to(DEVICE).requires_grad_(True)
    d_g = torch.randn(2, b, b, generator=gen).to(DEVICE)
    g = cayley_neumann_fused(packed, b, layout=layout)
    saved = g.grad_fn.saved_tensors
    assert len(saved) == 1 and saved[0].data_ptr() == packed.data_ptr()
    g.backward(d_g)
    ref = reference_grad(packed.detach().cpu().double(), d_g.cpu().double(), b)
    assert (packed.grad.double().cpu() - ref).abs().max().item() <= FP32_ATOL
    with torch.no_grad():
        again = cayley_neumann_fused(packed, b, layout=layout)
    assert again.grad_fn is None and torch.equal(again, g.detach())


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
