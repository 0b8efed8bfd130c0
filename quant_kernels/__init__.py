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

* Cayley–Neumann blocks (:func:`cayley_neumann`, :func:`cayley_neumann_lean`): the torch path.
  The fused Triton CNP (:mod:`quant_kernels.cnp_triton`, ``k = 3``, fp32/bf16/fp16) is opt-in
  until ``evals/bench_cnp.py`` has timed it on the GPU (:data:`FUSED_CNP_MEASURED_FASTER`).

``POETXQ_KERNELS=fused`` forces the fused kernels everywhere on CUDA, ``POETXQ_KERNELS=torch`` the
torch path. This package imports only torch (Triton lazily, on first use).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from quant_kernels import cnp, reference
from quant_kernels.block_diag import block_diag_grad, block_diag_matmul
from quant_kernels.reference import (
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

#: whether ``POETXQ_KERNELS=auto`` picks the fused Triton CNP (k = 3) on CUDA. False until the GPU
#: benchmark (``python evals/bench_cnp.py``, Llama-8B blocks at b = 256) measures it faster than
#: the torch path; ``POETXQ_KERNELS=fused`` uses it regardless.
FUSED_CNP_MEASURED_FASTER = False
_FUSED_CNP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def _fused_cnp(packed: torch.Tensor, terms: int) -> bool:
    """Whether the fused Triton CNP serves this call (CUDA, Triton, ``k = 3``, fp32/bf16/fp16 and
    the policy of :func:`triton_enabled` with :data:`FUSED_CNP_MEASURED_FASTER`)."""
    return (
        terms == 3
        and packed.dtype in _FUSED_CNP_DTYPES
        and triton_enabled(packed, measured_faster=FUSED_CNP_MEASURED_FASTER)
    )


def cayley_neumann(packed: torch.Tensor, block_size: int, terms: int = 3) -> torch.Tensor:
    """Cayley–Neumann blocks ``G [nb, b, b]`` from packed skew parameters ``[nb, b(b-1)/2]``
    (:func:`quant_kernels.reference.cayley_neumann`: same arguments, result and errors).

    Dispatch: the fused Triton kernels (:mod:`quant_kernels.cnp_triton`) when
    :func:`_fused_cnp` allows; otherwise the torch reference under plain autograd.
    """
    if _fused_cnp(packed, terms):
        from quant_kernels.cnp_triton import cayley_neumann_fused

        return cayley_neumann_fused(packed, block_size, terms)
    return reference.cayley_neumann(packed, block_size, terms)


def cayley_neumann_lean(packed: torch.Tensor, block_size: int, terms: int = 3) -> torch.Tensor:
    """:func:`cayley_neumann` that saves only ``packed`` for backward
    (:func:`quant_kernels.cnp.cayley_neumann_lean`; the fused kernels save only ``packed`` too).
    """
    if _fused_cnp(packed, terms):
        from quant_kernels.cnp_triton import cayley_neumann_fused

        return cayley_neumann_fused(packed, block_size, terms)
    return cnp.cayley_neumann_lean(packed, block_size, terms)
