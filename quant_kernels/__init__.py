"""Low-bit GEMM and orthogonal-block kernels for POET-XQ.

The functions exported here are the single entry points the POET-X(Q) layer calls. On CUDA tensors
(with Triton importable) the GEMMs against the frozen weight run as fused Triton dequant-matmul
kernels (:mod:`quant_kernels.dequant_matmul`); everywhere else the plain-torch references of
:mod:`quant_kernels.reference` run, and they remain the test oracle. This package imports only
torch (Triton lazily, on first CUDA use).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from quant_kernels import reference
from quant_kernels.reference import (
    block_diag_matmul,
    cayley_neumann,
    dequant_int8_rowwise,
    quantize_int8_rowwise,
    skew_from_packed,
)

__all__ = [
    "block_diag_matmul",
    "blockwise_4bit_matmul",
    "blockwise_4bit_matmul_t",
    "cayley_neumann",
    "dequant_int8_rowwise",
    "int8_rowwise_matmul",
    "int8_rowwise_matmul_t",
    "quantize_int8_rowwise",
    "skew_from_packed",
    "triton_enabled",
]

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_enabled(t: torch.Tensor) -> bool:
    """Whether the Triton kernels serve ``t``: a CUDA tensor, Triton installed, and not disabled
    by ``POETXQ_DISABLE_TRITON=1`` (which forces the torch reference path everywhere)."""
    return t.is_cuda and _HAS_TRITON and os.environ.get("POETXQ_DISABLE_TRITON", "0") != "1"


def int8_rowwise_matmul(x: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """``x @ Wᵀ`` with ``W = CB · SCB/127`` (``x [..., K]``, ``CB`` int8 ``[N, K]``) → ``[..., N]``.

    Fused Triton kernel on CUDA (the weight is never materialized); torch reference otherwise.
    """
    if triton_enabled(x):
        from quant_kernels.dequant_matmul import int8_matmul

        return int8_matmul(x, cb, scb)
    return reference.int8_rowwise_matmul(x, cb, scb)


def int8_rowwise_matmul_t(g: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """``g @ W`` with ``W = CB · SCB/127`` (``g [..., N]``) → ``[..., K]`` (the dX GEMM)."""
    if triton_enabled(g):
        from quant_kernels.dequant_matmul import int8_matmul_t

        return int8_matmul_t(g, cb, scb)
    return reference.int8_rowwise_matmul_t(g, cb, scb)


def blockwise_4bit_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """``x @ Wᵀ`` for a bitsandbytes NF4/FP4 blockwise weight ``W [N, K]`` → ``[..., N]``.

    ``absmax`` is fp32 (double-quantized statistics dequantized first). Fused Triton kernel on
    CUDA; the torch reference (:mod:`quant_kernels.reference_4bit`) otherwise.
    """
    from quant_kernels import reference_4bit

    if triton_enabled(x):
        from quant_kernels.dequant_matmul import blockwise_4bit_matmul as fused

        code = reference_4bit.get_4bit_code(quant_type, x.device)
        return fused(x, packed, absmax, code, blocksize, shape)
    return reference_4bit.blockwise_4bit_matmul(x, packed, absmax, quant_type, blocksize, shape)


def blockwise_4bit_matmul_t(
    g: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """``g @ W`` for a bitsandbytes NF4/FP4 weight ``W [N, K]`` (``g [..., N]``) → ``[..., K]``."""
    from quant_kernels import reference_4bit

    if triton_enabled(g):
        from quant_kernels.dequant_matmul import blockwise_4bit_matmul_t as fused

        code = reference_4bit.get_4bit_code(quant_type, g.device)
        return fused(g, packed, absmax, code, blocksize, shape)
    return reference_4bit.blockwise_4bit_matmul_t(g, packed, absmax, quant_type, blocksize, shape)
