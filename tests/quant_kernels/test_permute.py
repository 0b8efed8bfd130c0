"""Triton last-dim permutation vs torch indexing (CPU: Triton interpreter)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs a GPU or TRITON_INTERPRET=1 (set by tests/conftest.py)", allow_module_level=True
    )

from quant_kernels import reference
from quant_kernels.permute import permute_last_nograd, permute_last_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# rows not a multiple of the row tile, columns not a multiple of the column chunk, 3-D input
@pytest.mark.parametrize("shape", [(5, 37), (2, 3, 70), (1, 1), (0, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_indexing_exactly(shape, dtype, gen):
    x = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(shape[-1], generator=gen)
    out = permute_last_nograd(x.to(DEVICE), perm.to(DEVICE))
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out.cpu(), x[..., perm])


def test_strided_rows_and_backward_is_the_inverse_permutation(gen):
    base = torch.randn(6, 50, generator=gen)
    x = base[:, 5:45].to(DEVICE).requires_grad_(True)  # row stride 50, unit column stride
    perm = torch.randperm(40, generator=gen).to(DEVICE)
    y = permute_last_triton(x, perm, torch.argsort(perm))
    assert torch.equal(y.detach().cpu(), base[:, 5:45][:, perm.cpu()])
    d_y = torch.randn(6, 40, generator=gen)
    y.backward(d_y.to(DEVICE))
    want = torch.zeros(6, 40)
    want[:, perm.cpu()] = d_y  # d x[:, perm[j]] = d y[:, j]
    assert torch.equal(x.grad.cpu(), want)


def test_transposed_input_is_copied_first(gen):
    x = torch.randn(30, 4, generator=gen).t()  # last dim has stride 4
    perm = torch.randperm(30, generator=gen)
    assert torch.equal(permute_last_nograd(x.to(DEVICE), perm.to(DEVICE)).cpu(), x[:, perm])


def test_bad_perm_is_an_error():
    with pytest.raises(ValueError, match=r"perm must be 1-D of length 8 \(x's last dim\)"):
        permute_last_nograd(torch.zeros(2, 8, device=DEVICE), torch.arange(7, device=DEVICE))


@pytest.mark.parametrize("impl", [reference.permute_last, permute_last_triton])
@pytest.mark.parametrize("give_inverse", [True, False])
def test_backward_gathers_by_the_inverse_permutation(impl, give_inverse, gen):
    # float64 against the hand scatter d x[..., perm[j]] = d y[..., j]; the graph holds one
    # PermuteLast node (a gather backward), not index_select's scatter-add (index_add_)
    x = torch.randn(3, 4, 29, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_(True)
    perm = torch.randperm(29, generator=gen).to(DEVICE)
    y = impl(x, perm, torch.argsort(perm) if give_inverse else None)
    assert type(y.grad_fn).__name__ == "PermuteLastBackward"
    assert torch.equal(y.detach(), x.detach()[..., perm])
    d_y = torch.randn(3, 4, 29, generator=gen, dtype=torch.float64).to(DEVICE)
    y.backward(d_y)
    want = torch.zeros_like(d_y)
    want[..., perm] = d_y
    assert torch.equal(x.grad, want)
    with torch.no_grad():  # no autograd node without grad
        assert impl(x, perm).grad_fn is None


@pytest.mark.parametrize("impl", [reference.permute_last, permute_last_triton])
def test_double_backward_is_a_gather_too(impl, gen):
    x = torch.randn(2, 9, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_(True)
    perm = torch.randperm(9, generator=gen).to(DEVICE)
    assert torch.autograd.gradcheck(lambda t: impl(t, perm), (x,))
    assert torch.autograd.gradgradcheck(lambda t: impl(t, perm).square(), (x,))
