"""The strided-bmm block-diagonal multiply against the einsum reference and the dense matrix."""

import pytest
import torch

from quant_kernels.block_diag import block_diag_grad, block_diag_matmul
from quant_kernels.reference import block_diag_matmul as reference_block_diag_matmul


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


def test_forward_equals_dense_and_reference(gen):
    g = torch.randn(3, 4, 4, generator=gen, dtype=torch.float64)
    x = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64)
    dense = x @ torch.block_diag(*g).t()
    torch.testing.assert_close(block_diag_matmul(x, g), dense)
    torch.testing.assert_close(block_diag_matmul(x, g), reference_block_diag_matmul(x, g))


def test_non_contiguous_input_and_transposed_blocks(gen):
    g = torch.randn(2, 3, 3, generator=gen, dtype=torch.float64)
    wide = torch.randn(7, 10, generator=gen, dtype=torch.float64)
    x = wide[:, 2:8]  # a strided view, as after slicing off padding
    gt = g.transpose(1, 2)
    out = block_diag_matmul(x, gt)
    torch.testing.assert_close(out, x @ torch.block_diag(*gt).t())
    assert out.is_contiguous()


def test_gradients_equal_autograd_through_the_reference(gen):
    g = torch.randn(3, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(6, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 12, generator=gen, dtype=torch.float64)
    (block_diag_matmul(x, g) * w).sum().backward()
    gx, gg = x.grad.clone(), g.grad.clone()
    x.grad = g.grad = None
    (reference_block_diag_matmul(x, g) * w).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gg, g.grad)


def test_block_grad_equals_einsum(gen):
    d_out = torch.randn(4, 5, 8, generator=gen, dtype=torch.float64)
    inp = torch.randn(4, 5, 8, generator=gen, dtype=torch.float64)
    expect = torch.einsum("tkd,tkc->kdc", d_out.reshape(-1, 2, 4), inp.reshape(-1, 2, 4))
    torch.testing.assert_close(block_diag_grad(d_out, inp, 2, 4), expect)


def test_wrong_width_is_rejected():
    with pytest.raises(ValueError, match="nb\\*b"):
        block_diag_matmul(torch.zeros(2, 10), torch.zeros(3, 4, 4))
