"""Triton skew-block build vs the reference ``index_copy`` build (CPU: Triton interpreter)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs a GPU or TRITON_INTERPRET=1 (set by tests/conftest.py)", allow_module_level=True
    )

from quant_kernels.reference import skew_from_packed
from quant_kernels.skew import skew_from_packed_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# b = 2 (one entry), 17 and 40 (partial tiles), 64 (whole tiles); 0 blocks
@pytest.mark.parametrize("nb,b", [(3, 2), (2, 17), (1, 40), (2, 64), (0, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradient_equal_reference_bit_for_bit(nb, b, dtype, gen):
    packed = torch.randn(nb, b * (b - 1) // 2, generator=gen).to(dtype)
    d_q = torch.randn(nb, b, b, generator=gen).to(dtype)
    ref_leaf = packed.clone().requires_grad_(True)
    ref = skew_from_packed(ref_leaf, b)
    ref.backward(d_q)
    leaf = packed.to(DEVICE).requires_grad_(True)
    q = skew_from_packed_triton(leaf, b)
    assert q.shape == (nb, b, b) and q.dtype == dtype
    assert torch.equal(q.detach().cpu(), ref.detach())
    assert torch.equal(q.detach().cpu().transpose(1, 2), -ref.detach())
    q.backward(d_q.to(DEVICE))
    # ∂packed[idx(i, j)] = ∂Q[i, j] − ∂Q[j, i], as autograd through index_copy and U − Uᵀ gives;
    # the interpreter truncates fp32 → bf16 where the GPU (and torch) round: one ulp there
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(leaf.grad.cpu(), ref_leaf.grad)
    else:
        torch.testing.assert_close(leaf.grad.cpu(), ref_leaf.grad, rtol=2**-7, atol=0)


def test_hand_built_block(gen):
    # b = 3: packed (q01, q02, q12) → [[0, q01, q02], [−q01, 0, q12], [−q02, −q12, 0]]
    packed = torch.tensor([[1.0, 2.0, 3.0]], device=DEVICE)
    want = torch.tensor([[[0.0, 1.0, 2.0], [-1.0, 0.0, 3.0], [-2.0, -3.0, 0.0]]])
    assert torch.equal(skew_from_packed_triton(packed, 3).cpu(), want)


def test_wrong_width_is_an_error():
    with pytest.raises(ValueError, match=r"packed must be \[nb, 6\] for b=4, got \(2, 5\)"):
        skew_from_packed_triton(torch.zeros(2, 5, device=DEVICE), 4)
