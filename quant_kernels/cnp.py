"""Cayley–Neumann blocks whose backward recomputes the intermediates instead of saving them.

:func:`quant_kernels.reference.cayley_neumann` under plain autograd keeps ``Q``, ``Q²`` and the
inner factor of every block alive until backward — ``(k·q + c)·b²`` bytes per block, about a
fifth of all activation memory of a Llama-8B POET-XQ step. :func:`cayley_neumann_lean` saves only
its packed input (usually a parameter, which is alive anyway) and recomputes the forward under
autograd in backward: two extra batched ``b×b`` matmuls per block per step, no saved
intermediates. Values and gradients equal the reference exactly (same ops, same order).

On CUDA the skew blocks ``Q = U − Uᵀ`` are built by the Triton kernels of
:mod:`quant_kernels.skew` (bit-identical to the reference's ``index_copy``, without its
scatter/gather kernels) where the caller's :class:`~quant_kernels.policy.KernelPolicy` allows
Triton; :func:`cayley_neumann` here is the reference with that one step swapped.
"""

from __future__ import annotations

import torch

from quant_kernels import reference
from quant_kernels.policy import AUTO, TRITON_DTYPES, KernelPolicy


def skew_from_packed(
    packed: torch.Tensor, block_size: int, *, kernels: KernelPolicy = AUTO
) -> torch.Tensor:
    """:func:`quant_kernels.reference.skew_from_packed` (same arguments, result, gradient and
    errors), by the Triton kernels of :mod:`quant_kernels.skew` for fp32/bf16/fp16 where
    ``kernels.uses_triton`` (CUDA)."""
    if kernels.uses_triton(packed) and packed.dtype in TRITON_DTYPES:
        from quant_kernels.skew import skew_from_packed_triton

        return skew_from_packed_triton(packed, block_size)
    return reference.skew_from_packed(packed, block_size)


def cayley_neumann(
    packed: torch.Tensor, block_size: int, terms: int = 3, *, kernels: KernelPolicy = AUTO
) -> torch.Tensor:
    """:func:`quant_kernels.reference.cayley_neumann` (same arguments, result and errors) with
    the skew blocks from :func:`skew_from_packed`."""
    if terms < 1:
        raise ValueError(f"Neumann terms k must be >= 1, got {terms}")
    return reference.cnp_from_skew(skew_from_packed(packed, block_size, kernels=kernels), terms)


class _CayleyNeumannLean(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, packed: torch.Tensor, block_size: int, terms: int, kernels: KernelPolicy
    ) -> torch.Tensor:
        ctx.save_for_backward(packed)
        ctx.block_size, ctx.terms, ctx.kernels = block_size, terms, kernels
        return cayley_neumann(packed, block_size, terms, kernels=kernels)

    @staticmethod
    def backward(ctx, d_g: torch.Tensor):  # type: ignore[override]
        (packed,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = packed.detach().requires_grad_(True)
            g = cayley_neumann(leaf, ctx.block_size, ctx.terms, kernels=ctx.kernels)
            (d_packed,) = torch.autograd.grad(g, leaf, d_g)
        return d_packed, None, None, None


def cayley_neumann_lean(
    packed: torch.Tensor, block_size: int, terms: int = 3, *, kernels: KernelPolicy = AUTO
) -> torch.Tensor:
    """:func:`~quant_kernels.reference.cayley_neumann` that saves only ``packed`` for backward.

    Args:
        packed: ``[nb, b(b-1)/2]`` float (strict upper triangles, ``torch.triu_indices`` order).
        block_size: ``b``.
        terms: Neumann order ``k ≥ 1``.
        kernels: whether the skew blocks may be built by Triton (:func:`skew_from_packed`).

    Returns:
        ``G`` ``[nb, b, b]`` in ``packed.dtype``; differentiable w.r.t. ``packed``.

    Raises:
        ValueError: ``k < 1`` or ``packed`` has the wrong width for ``b``.
    """
    # under torch.compile the plain ops: the compiler decides what to save or recompute, and the
    # lean backward's torch.autograd.grad would break the graph
    if torch.is_grad_enabled() and packed.requires_grad and not torch.compiler.is_compiling():
        return _CayleyNeumannLean.apply(packed, block_size, terms, kernels)
    return cayley_neumann(packed, block_size, terms, kernels=kernels)
