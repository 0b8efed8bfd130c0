"""Low-bit GEMM and orthogonal-block kernels for POET-XQ.

The entry points below are what the POET-X(Q) layer calls; each takes the layer's
:class:`KernelPolicy` as ``kernels`` and runs the path it names: the weight formats' GEMMs
(:mod:`quant_kernels.formats`: :class:`Int8Rowwise`, :class:`Blockwise4bit`, :class:`Dense`),
the Cayley–Neumann blocks (:func:`cayley_neumann`) and the permutations
(:mod:`quant_kernels.ops`). The plain-torch references (:mod:`quant_kernels.reference`,
:mod:`quant_kernels.reference_4bit`, :mod:`quant_kernels.reference_double_quant`) serve CPU
tensors and are the test oracle. Which kernel runs when, and why: ``docs/KERNELS.md``. This
package imports only torch (Triton lazily, on first use).
"""

from __future__ import annotations

from quant_kernels import cnp, reference
from quant_kernels.block_diag import block_diag_grad, block_diag_matmul
from quant_kernels.cnp import cayley_neumann, skew_from_packed
from quant_kernels.formats import Blockwise4bit, Dense, Int8Rowwise, WeightFormat
from quant_kernels.ops import (
    permute_last,
    permute_to_feature_major,
    permute_to_row_major,
)
from quant_kernels.policy import (
    AUTO,
    HAS_TRITON,
    KERNEL_MODES,
    KernelPolicy,
    default_policy,
    slab_bytes_for,
)
from quant_kernels.reference import dequant_int8_rowwise, quantize_int8_rowwise

__all__ = [
    "AUTO",
    "HAS_TRITON",
    "KERNEL_MODES",
    "Blockwise4bit",
    "Dense",
    "Int8Rowwise",
    "KernelPolicy",
    "WeightFormat",
    "block_diag_grad",
    "block_diag_matmul",
    "cayley_neumann",
    "cnp",
    "default_policy",
    "dequant_int8_rowwise",
    "permute_last",
    "permute_to_feature_major",
    "permute_to_row_major",
    "quantize_int8_rowwise",
    "reference",
    "skew_from_packed",
    "slab_bytes_for",
]
