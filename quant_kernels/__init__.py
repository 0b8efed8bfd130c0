"""Low-bit GEMM and orthogonal-block kernels for POET-XQ.

The functions exported here are the single entry points the POET-X(Q) layer calls. Today they are
the plain-torch references in :mod:`quant_kernels.reference`; the fused Triton kernels (dequant-
matmul, Cayley–Neumann, permutation-fused block-diagonal multiply) slot in behind these same names
and keep the reference as the CPU fallback and test oracle. This package imports only torch.
"""

from quant_kernels.reference import (
    block_diag_matmul,
    cayley_neumann,
    dequant_int8_rowwise,
    int8_rowwise_matmul,
    int8_rowwise_matmul_t,
    quantize_int8_rowwise,
    skew_from_packed,
)

__all__ = [
    "block_diag_matmul",
    "cayley_neumann",
    "dequant_int8_rowwise",
    "int8_rowwise_matmul",
    "int8_rowwise_matmul_t",
    "quantize_int8_rowwise",
    "skew_from_packed",
]
