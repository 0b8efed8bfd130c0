"""The torch.library ops (quant_kernels.library): values against independent float64 products,
gradients of the activation, and torch.library.opcheck (schema, fake kernel, autograd
registration, AOT dispatch) on the CPU reference implementation."""

import pytest
import torch

import quant_kernels.library  # noqa: F401  (registers torch.ops.poetxq.*)
from quant_kernels.reference import quantize_int8_rowwise

ops = torch.ops.poetxq


def _int8(n: int, k: int, gen: torch.Generator):
    cb, scb = quantize_int8_rowwise(torch.randn(n, k, generator=gen))
    w64 = cb.double() * (scb.double() / 127).unsqueeze(1)  # the layout's definition
    return cb, scb, w64


def test_int8_ops_equal_a_float64_product_and_differentiate_the_activation(gen):
    cb, scb, w64 = _int8(7, 12, gen)
    x = torch.randn(2, 3, 12, generator=gen, requires_grad=True)
    y = ops.int8_rowwise_matmul(x, cb, scb, "auto")
    assert y.shape == (2, 3, 7) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), x.detach().double() @ w64.t(), rtol=1e-5, atol=1e-5)
    dy = torch.randn(2, 3, 7, generator=gen)
    y.backward(dy)
    torch.testing.assert_close(x.grad.double(), dy.double() @ w64, rtol=1e-5, atol=1e-5)
    g = torch.randn(4, 7, generator=gen)
    torch.testing.assert_close(
        ops.int8_rowwise_matmul_t(g, cb, scb).double(), g.double() @ w64, rtol=1e-5, atol=1e-5
    )


def test_4bit_ops_equal_bitsandbytes_dequant_product(gen):
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    n, k = 6, 128
    packed, state = bnb_functional.quantize_4bit(
        torch.randn(n, k, generator=gen), blocksize=64, quant_type="nf4"
    )
    w64 = bnb_functional.dequantize_4bit(packed, state).double()  # bitsandbytes' own decoder
    absmax = state.absmax.float()
    x = torch.randn(3, k, generator=gen, requires_grad=True)
    y = ops.blockwise_4bit_matmul(x, packed, absmax, "nf4", 64, n, k, "auto")
    torch.testing.assert_close(y.double(), x.detach().double() @ w64.t(), rtol=1e-5, atol=1e-5)
    dy = torch.randn(3, n, generator=gen)
    y.backward(dy)
    torch.testing.assert_close(x.grad.double(), dy.double() @ w64, rtol=1e-5, atol=1e-5)
    g = torch.randn(3, n, generator=gen)
    dx = ops.blockwise_4bit_matmul_t(g, packed, absmax, "nf4", 64, n, k)
    torch.testing.assert_close(dx.double(), g.double() @ w64, rtol=1e-5, atol=1e-5)


def test_opcheck_every_op(gen):
    cb, scb, _ = _int8(5, 8, gen)
    x = torch.randn(3, 8, generator=gen, requires_grad=True)
    g = torch.randn(3, 5, generator=gen, requires_grad=True)
    torch.library.opcheck(ops.int8_rowwise_matmul, (x, cb, scb, "auto"))
    torch.library.opcheck(ops.int8_rowwise_matmul_t, (g, cb, scb, "torch"))
    from quant_kernels.reference_4bit import quantize_4bit_blockwise

    n, k = 4, 64
    packed, absmax = quantize_4bit_blockwise(torch.randn(n, k, generator=gen), "nf4", 64)[:2]
    x4 = torch.randn(2, k, generator=gen, requires_grad=True)
    g4 = torch.randn(2, n, generator=gen, requires_grad=True)
    args = (packed, absmax.float(), "nf4", 64, n, k, "auto")
    torch.library.opcheck(ops.blockwise_4bit_matmul, (x4, *args))
    torch.library.opcheck(ops.blockwise_4bit_matmul_t, (g4, *args))


def test_ops_compile_as_single_nodes(gen):
    cb, scb, w64 = _int8(5, 8, gen)
    fn = torch.compile(lambda t: ops.int8_rowwise_matmul(t, cb, scb, "auto") * 2, fullgraph=True)
    x = torch.randn(3, 8, generator=gen)
    torch.testing.assert_close(fn(x).double(), 2 * (x.double() @ w64.t()), rtol=1e-5, atol=1e-5)
