"""Low-bit GEMM and orthogonal-block kernels for POET-XQ.

The functions exported here are the single entry points the POET-X(Q) layer calls. Each picks, per
call, the fastest *measured* correct path; the plain-torch references
(:mod:`quant_kernels.reference`, :mod:`quant_kernels.reference_4bit`) run on the CPU and remain
the test oracle.

Dispatch on CUDA, from the H200 measurements in ``evals/results/dequant_matmul_h200.json``:

* int8 forward ``x @ Wᵀ``: fused Triton kernel (:mod:`quant_kernels.dequant_matmul`) when the
  token count M ≤ 4096 (1.52× bf16 vs 2.05× for dequantize-then-cuBLAS at M = 2048); above that,
  dequantize-then-cuBLAS (1.24–1.38× vs 1.44–1.63×).
* int8 dX ``g @ W`` and all 4-bit GEMMs: dequantize-then-cuBLAS (the fused dX kernel measured
  1.8–2.4×, the fused NF4 kernels 20–60×: correct, not yet fast). The dequantized weight is a
  transient of one layer, freed on return; no float copy persists.

``POETXQ_KERNELS=fused`` forces the fused kernels everywhere on CUDA, ``POETXQ_KERNELS=torch`` the
torch path. This package imports only torch (Triton lazily, on first use).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from quant_kernels import reference
from quant_kernels.block_diag import block_diag_grad, block_diag_matmul
from quant_kernels.cnp import cayley_neumann_lean
from quant_kernels.reference import (
    cayley_neumann,
    dequant_int8_rowwise,
    quantize_int8_rowwise,
    skew_from_packed,
)

__all__ = [
    "block_diag_grad",
    "block_diag_matmul",
    "blockwise_4bit_matmul",
    "blockwise_4bit_matmul_t",
    "cayley_neumann",
    "cayley_neumann_lean",
    "dequant_int8_rowwise",
    "int8_rowwise_matmul",
    "int8_rowwise_matmul_t",
    "quantize_int8_rowwise",
    "skew_from_packed",
    "triton_enabled",
]

_HAS_TRITON = importlib.util.find_spec("triton") is not None


#: int8 forward uses the fused kernel up to this many tokens (rows of x); see module docstring
FUSED_INT8_FORWARD_MAX_M = 4096


def _policy() -> str:
    mode = os.environ.get("POETXQ_KERNELS", "auto")
    if mode not in ("auto", "fused", "torch"):
        raise ValueError(f"POETXQ_KERNELS={mode!r}; use auto, fused or torch")
    return mode


def triton_enabled(t: torch.Tensor, *, measured_faster: bool = True) -> bool:
    """Whether a fused Triton kernel serves ``t``: a CUDA tensor, Triton installed, and either
    ``POETXQ_KERNELS=fused`` or (default ``auto``) the kernel measured faster for this call."""
    if not (t.is_cuda and _HAS_TRITON):
        return False
    mode = _policy()
    return mode == "fused" or (mode == "auto" and measured_faster)


def _rows(t: torch.Tensor) -> int:
    return t.numel() // max(t.shape[-1], 1)


def int8_rowwise_matmul(x: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """``x @ Wᵀ`` with ``W = CB · SCB/127`` (``x [..., K]``, ``CB`` int8 ``[N, K]``) → ``[..., N]``.

    Dispatch: see the module docstring.
    """
    if triton_enabled(x, measured_faster=_rows(x) <= FUSED_INT8_FORWARD_MAX_M):
        from quant_kernels.dequant_matmul import int8_matmul

        return int8_matmul(x, cb, scb)
    return reference.int8_rowwise_matmul(x, cb, scb)


def int8_rowwise_matmul_t(g: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """``g @ W`` with ``W = CB · SCB/127`` (``g [..., N]``) → ``[..., K]`` (the dX GEMM)."""
    if triton_enabled(g, measured_faster=False):
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

    ``absmax`` is fp32 (double-quantized statistics dequantized first). Dispatch: see the module
    docstring.
    """
    from quant_kernels import reference_4bit

    if triton_enabled(x, measured_faster=False):
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

    if triton_enabled(g, measured_faster=False):
        from quant_kernels.dequant_matmul import blockwise_4bit_matmul_t as fused

        code = reference_4bit.get_4bit_code(quant_type, g.device)
        return fused(g, packed, absmax, code, blocksize, shape)
    return reference_4bit.blockwise_4bit_matmul_t(g, packed, absmax, quant_type, blocksize, shape)
