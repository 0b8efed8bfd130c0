"""Cayley–Neumann blocks whose backward recomputes the intermediates instead of saving them.

:func:`quant_kernels.reference.cayley_neumann` under plain autograd keeps ``Q``, ``Q²`` and the
inner factor of every block alive until backward — ``(k·q + c)·b²`` bytes per block, about a
fifth of all activation memory of a Llama-8B POET-XQ step. :func:`cayley_neumann_lean` saves only
its packed input (usually a parameter, which is alive anyway) and recomputes the forward under
autograd in backward: two extra batched ``b×b`` matmuls per block per step, no saved
intermediates. Values and gradients equal the reference exactly (same ops, same order).
"""

from __future__ import annotations

import torch

from quant_kernels.reference import cayley_neumann


class _CayleyNeumannLean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, packed: torch.Tensor, block_size: int, terms: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(packed)
        ctx.block_size, ctx.terms = block_size, terms
        return cayley_neumann(packed, block_size, terms)

    @staticmethod
    def backward(ctx, d_g: torch.Tensor):  # type: ignore[override]
        (packed,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = packed.detach().requires_grad_(True)
            g = cayley_neumann(leaf, ctx.block_size, ctx.terms)
            (d_packed,) = torch.autograd.grad(g, leaf, d_g)
        return d_packed, None, None


def cayley_neumann_lean(packed: torch.Tensor, block_size: int, terms: int = 3) -> torch.Tensor:
    """:func:`~quant_kernels.reference.cayley_neumann` that saves only ``packed`` for backward.

    Args:
        packed: ``[nb, b(b-1)/2]`` float (strict upper triangles, ``torch.triu_indices`` order).
        block_size: ``b``.
        terms: Neumann order ``k ≥ 1``.

    Returns:
        ``G`` ``[nb, b, b]`` in ``packed.dtype``; differentiable w.r.t. ``packed``.

    Raises:
        ValueError: ``k < 1`` or ``packed`` has the wrong width for ``b``.
    """
    if torch.is_grad_enabled() and packed.requires_grad:
        return _CayleyNeumannLean.apply(packed, block_size, terms)
    return cayley_neumann(packed, block_size, terms)
