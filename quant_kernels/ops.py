"""The permutation entry points of the POET-X(Q) layer: the row-major gather (its reference, also
the CPU path) and the feature-major permute-transposes (:mod:`quant_kernels.transpose_perm`,
Triton, imported on first use, so this module imports only torch). The weight GEMMs are the
weight formats' (:mod:`quant_kernels.formats`), the Cayley–Neumann blocks
:func:`quant_kernels.cnp.cayley_neumann`'s.
"""

from __future__ import annotations

import torch

from quant_kernels import reference

__all__ = [
    "permute_last",
    "permute_to_feature_major",
    "permute_to_row_major",
]


def permute_last(
    x: torch.Tensor, perm: torch.Tensor, inv_perm: torch.Tensor | None = None
) -> torch.Tensor:
    """``x[..., perm]`` for ``x [..., d]`` and a permutation ``perm [d]`` (int64, ``x``'s device):
    :func:`quant_kernels.reference.permute_last` (torch ``index_select``, whose backward gathers
    by ``inv_perm``). Differentiable w.r.t. ``x``.
    """
    return reference.permute_last(x, perm, inv_perm)


def permute_to_feature_major(
    x: torch.Tensor, inv_perm: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """:func:`quant_kernels.transpose_perm.permute_to_feature_major` (Triton, imported on first
    use): the layers call it only on their feature-major path."""
    from quant_kernels import transpose_perm

    return transpose_perm.permute_to_feature_major(x, inv_perm, out_dtype=out_dtype)


def permute_to_row_major(
    xt: torch.Tensor, perm: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """:func:`quant_kernels.transpose_perm.permute_to_row_major` (Triton, imported on first
    use)."""
    from quant_kernels import transpose_perm

    return transpose_perm.permute_to_row_major(xt, perm, out_dtype=out_dtype)
