"""The public dequant-matmul ops registered with ``torch.library`` (namespace ``poetxq``).

Each op has one schema, a CPU implementation that is the plain-torch reference
(:mod:`quant_kernels.reference` / :mod:`quant_kernels.reference_4bit`), a CUDA implementation
that dispatches as the weight formats of :mod:`quant_kernels.formats` do for the ``path`` it is
given (``auto``,
``fused``, ``streamed`` or ``torch``: :attr:`~quant_kernels.policy.KernelPolicy.weight_gemm`), a
fake (meta) implementation that only states the output's shape and dtype, and an autograd
formula for the activation (the weight is frozen: no gradient). So the ops trace under
``torch.compile`` and ``torch.export`` as single nodes instead of as Triton launches.

    torch.ops.poetxq.int8_rowwise_matmul(x, cb, scb, "auto")       # x @ Wᵀ, W = CB · SCB/127
    torch.ops.poetxq.int8_rowwise_matmul_t(g, cb, scb, "auto")     # g @ W
    torch.ops.poetxq.blockwise_4bit_matmul(x, packed, absmax, "nf4", 64, n, k, "auto")
    torch.ops.poetxq.blockwise_4bit_matmul_t(g, packed, absmax, "nf4", 64, n, k, "auto")

The layer calls the weight formats directly (same values; its own autograd Functions).
``tests/quant_kernels/test_library.py`` checks every op with ``torch.library.opcheck``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from quant_kernels import reference, reference_4bit
from quant_kernels.formats import Blockwise4bit, Int8Rowwise
from quant_kernels.policy import KernelPolicy

__all__ = [
    "blockwise_4bit_matmul",
    "blockwise_4bit_matmul_t",
    "int8_rowwise_matmul",
    "int8_rowwise_matmul_t",
]


def _kernels(path: str) -> KernelPolicy:
    """The policy whose ``weight_gemm`` is ``path`` (the other fields at their defaults)."""
    return KernelPolicy(weight_gemm=path)


def _out(act: Tensor, features: int) -> Tensor:
    """An empty ``[..., features]`` result in ``act``'s dtype and device (the fake kernels)."""
    return act.new_empty(*act.shape[:-1], features)


# ----------------------------------------------------------------------------------------------
# int8 row-wise
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("poetxq::int8_rowwise_matmul", mutates_args=(), device_types="cpu")
def int8_rowwise_matmul(x: Tensor, cb: Tensor, scb: Tensor, path: str = "auto") -> Tensor:
    """``x @ Wᵀ`` with ``W = CB · SCB/127`` (``x [..., K]``, ``CB`` int8 ``[N, K]``, ``SCB``
    fp32 ``[N]``) → ``[..., N]`` in ``x.dtype``; CPU: the reference."""
    return reference.int8_rowwise_matmul(x, cb, scb)


@int8_rowwise_matmul.register_kernel("cuda")
def _int8_rowwise_matmul_cuda(x: Tensor, cb: Tensor, scb: Tensor, path: str = "auto") -> Tensor:
    return Int8Rowwise(cb, scb).matmul(x, kernels=_kernels(path))


@int8_rowwise_matmul.register_fake
def _int8_rowwise_matmul_fake(x: Tensor, cb: Tensor, scb: Tensor, path: str = "auto") -> Tensor:
    return _out(x, cb.shape[0])


@torch.library.custom_op("poetxq::int8_rowwise_matmul_t", mutates_args=(), device_types="cpu")
def int8_rowwise_matmul_t(g: Tensor, cb: Tensor, scb: Tensor, path: str = "auto") -> Tensor:
    """``g @ W`` with ``W = CB · SCB/127`` (``g [..., N]``) → ``[..., K]`` in ``g.dtype`` (the
    dX GEMM); CPU: the reference."""
    return reference.int8_rowwise_matmul_t(g, cb, scb)


@int8_rowwise_matmul_t.register_kernel("cuda")
def _int8_rowwise_matmul_t_cuda(g: Tensor, cb: Tensor, scb: Tensor, path: str = "auto") -> Tensor:
    return Int8Rowwise(cb, scb).matmul_t(g, kernels=_kernels(path))


@int8_rowwise_matmul_t.register_fake
def _int8_rowwise_matmul_t_fake(g: Tensor, cb: Tensor, scb: Tensor, path: str = "auto") -> Tensor:
    return _out(g, cb.shape[1])


def _int8_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    _, cb, scb, path = inputs
    ctx.save_for_backward(cb, scb)
    ctx.path = path


def _int8_backward(ctx: Any, grad: Tensor) -> tuple:
    cb, scb = ctx.saved_tensors
    return torch.ops.poetxq.int8_rowwise_matmul_t(grad, cb, scb, ctx.path), None, None, None


def _int8_t_backward(ctx: Any, grad: Tensor) -> tuple:
    cb, scb = ctx.saved_tensors
    return torch.ops.poetxq.int8_rowwise_matmul(grad, cb, scb, ctx.path), None, None, None


int8_rowwise_matmul.register_autograd(_int8_backward, setup_context=_int8_setup)
int8_rowwise_matmul_t.register_autograd(_int8_t_backward, setup_context=_int8_setup)


# ----------------------------------------------------------------------------------------------
# 4-bit NF4 / FP4 blockwise (bitsandbytes Params4bit layout), W [n, k]
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("poetxq::blockwise_4bit_matmul", mutates_args=(), device_types="cpu")
def blockwise_4bit_matmul(
    x: Tensor, packed: Tensor, absmax: Tensor, quant_type: str, blocksize: int, n: int, k: int,
    path: str = "auto",
) -> Tensor:  # fmt: skip
    """``x @ Wᵀ`` for a bitsandbytes NF4/FP4 weight ``W [n, k]`` (``packed`` uint8, ``absmax``
    fp32) → ``[..., n]`` in ``x.dtype``; CPU: the reference."""
    return reference_4bit.blockwise_4bit_matmul(x, packed, absmax, quant_type, blocksize, (n, k))


@blockwise_4bit_matmul.register_kernel("cuda")
def _blockwise_4bit_matmul_cuda(
    x: Tensor, packed: Tensor, absmax: Tensor, quant_type: str, blocksize: int, n: int, k: int,
    path: str = "auto",
) -> Tensor:  # fmt: skip
    weight = Blockwise4bit(packed, absmax, quant_type, blocksize, (n, k))
    return weight.matmul(x, kernels=_kernels(path))


@blockwise_4bit_matmul.register_fake
def _blockwise_4bit_matmul_fake(
    x: Tensor, packed: Tensor, absmax: Tensor, quant_type: str, blocksize: int, n: int, k: int,
    path: str = "auto",
) -> Tensor:  # fmt: skip
    return _out(x, n)


@torch.library.custom_op("poetxq::blockwise_4bit_matmul_t", mutates_args=(), device_types="cpu")
def blockwise_4bit_matmul_t(
    g: Tensor, packed: Tensor, absmax: Tensor, quant_type: str, blocksize: int, n: int, k: int,
    path: str = "auto",
) -> Tensor:  # fmt: skip
    """``g @ W`` for a bitsandbytes NF4/FP4 weight ``W [n, k]`` (``g [..., n]``) → ``[..., k]``
    in ``g.dtype`` (the dX GEMM); CPU: the reference."""
    return reference_4bit.blockwise_4bit_matmul_t(g, packed, absmax, quant_type, blocksize, (n, k))


@blockwise_4bit_matmul_t.register_kernel("cuda")
def _blockwise_4bit_matmul_t_cuda(
    g: Tensor, packed: Tensor, absmax: Tensor, quant_type: str, blocksize: int, n: int, k: int,
    path: str = "auto",
) -> Tensor:  # fmt: skip
    weight = Blockwise4bit(packed, absmax, quant_type, blocksize, (n, k))
    return weight.matmul_t(g, kernels=_kernels(path))


@blockwise_4bit_matmul_t.register_fake
def _blockwise_4bit_matmul_t_fake(
    g: Tensor, packed: Tensor, absmax: Tensor, quant_type: str, blocksize: int, n: int, k: int,
    path: str = "auto",
) -> Tensor:  # fmt: skip
    return _out(g, k)


def _4bit_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    _, packed, absmax, *rest = inputs
    ctx.save_for_backward(packed, absmax)
    ctx.rest = rest  # quant_type, blocksize, n, k, path


def _4bit_backward(ctx: Any, grad: Tensor) -> tuple:
    packed, absmax = ctx.saved_tensors
    dx = torch.ops.poetxq.blockwise_4bit_matmul_t(grad, packed, absmax, *ctx.rest)
    return (dx, *([None] * 7))


def _4bit_t_backward(ctx: Any, grad: Tensor) -> tuple:
    packed, absmax = ctx.saved_tensors
    dg = torch.ops.poetxq.blockwise_4bit_matmul(grad, packed, absmax, *ctx.rest)
    return (dg, *([None] * 7))


blockwise_4bit_matmul.register_autograd(_4bit_backward, setup_context=_4bit_setup)
blockwise_4bit_matmul_t.register_autograd(_4bit_t_backward, setup_context=_4bit_setup)
