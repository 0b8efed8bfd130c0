"""The one Cayley–Neumann entry point: orthogonal blocks ``G`` from packed skew parameters.

:func:`cayley_neumann` takes the path the caller's :class:`~quant_kernels.policy.KernelPolicy`
names for the tensor at hand:

* the fused kernels of :mod:`quant_kernels.cnp_hybrid` (``fused_cnp``, ``k = 3``, a Triton
  dtype on CUDA), which save only the packed input;
* otherwise the torch path. :func:`quant_kernels.reference.cayley_neumann` under plain autograd
  keeps ``Q``, ``Q²`` and the inner factor of every block alive until backward —
  ``(k·q + c)·b²`` bytes per block, about a fifth of all activation memory of a Llama-8B
  POET-XQ step — so this path saves only its packed input (usually a parameter, which is alive
  anyway) and recomputes the forward under autograd in backward: two extra batched ``b×b``
  matmuls per block per step, no saved intermediates. Values and gradients equal the reference
  exactly (same ops, same order). On CUDA its skew blocks ``Q = U − Uᵀ`` are built by the
  Triton kernels of :mod:`quant_kernels.skew` (bit-identical to the reference's
  ``index_copy``, without its scatter/gather kernels) where the policy allows Triton.

The reference stays the oracle every path is tested against.
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


def _torch_cnp(
    packed: torch.Tensor, block_size: int, terms: int, kernels: KernelPolicy
) -> torch.Tensor:
    """:func:`quant_kernels.reference.cayley_neumann` (same arguments, result and errors) with
    the skew blocks from :func:`skew_from_packed`, under plain autograd."""
    if terms < 1:
        raise ValueError(f"Neumann terms k must be >= 1, got {terms}")
    return reference.cnp_from_skew(skew_from_packed(packed, block_size, kernels=kernels), terms)


class _CayleyNeumannLean(torch.autograd.Function):
    """:func:`_torch_cnp` saving only ``packed``; backward recomputes the forward under
    autograd."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, packed: torch.Tensor, block_size: int, terms: int, kernels: KernelPolicy
    ) -> torch.Tensor:
        ctx.save_for_backward(packed)
        ctx.block_size, ctx.terms, ctx.kernels = block_size, terms, kernels
        return _torch_cnp(packed, block_size, terms, kernels)

    @staticmethod
    def backward(ctx, d_g: torch.Tensor):  # type: ignore[override]
        (packed,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = packed.detach().requires_grad_(True)
            g = _torch_cnp(leaf, ctx.block_size, ctx.terms, ctx.kernels)
            (d_packed,) = torch.autograd.grad(g, leaf, d_g)
        return d_packed, None, None, None


def _autocast_input(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` in the dtype the torch reference's products would run in: under autocast on
    its device, fp32 ``packed`` cast to the autocast dtype (autocast runs the reference's
    ``bmm`` in bf16 and returns bf16 ``G``; the fused kernels, which autocast does not see, get
    that dtype this way, their elementwise terms in it too); otherwise ``packed`` itself."""
    dev = packed.device.type
    if packed.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return packed.to(torch.get_autocast_dtype(dev))
    return packed


def cayley_neumann(
    packed: torch.Tensor, block_size: int, terms: int = 3, *, kernels: KernelPolicy = AUTO
) -> torch.Tensor:
    """Cayley–Neumann blocks ``G = I + 2(Q + … + Q^k) + Q^{k+1}`` of packed skew parameters,
    saving only ``packed`` for backward (module docstring: which path runs).

    Args:
        packed: ``[nb, b(b-1)/2]`` float (strict upper triangles, ``torch.triu_indices`` order).
        block_size: ``b``.
        terms: Neumann order ``k ≥ 1``.
        kernels: the caller's policy: the fused kernels where ``kernels.fused_cnp_for`` allows
            (under autocast, fp32 ``packed`` enters them in the autocast dtype, as the
            reference computes there), else the torch path (its skew blocks by Triton where
            ``kernels.uses_triton``).

    Returns:
        ``G`` ``[nb, b, b]`` in ``packed.dtype`` (the autocast dtype on the fused path under
        autocast); differentiable w.r.t. ``packed``.

    Raises:
        ValueError: ``k < 1`` or ``packed`` has the wrong width for ``b``.
    """
    x = _autocast_input(packed)
    if kernels.fused_cnp_for(x, terms):
        from quant_kernels import cnp_hybrid

        return cnp_hybrid.cayley_neumann_fused(x, block_size, terms)
    # under torch.compile the plain ops: the compiler decides what to save or recompute, and the
    # lean backward's torch.autograd.grad would break the graph
    if torch.is_grad_enabled() and packed.requires_grad and not torch.compiler.is_compiling():
        return _CayleyNeumannLean.apply(packed, block_size, terms, kernels)
    return _torch_cnp(packed, block_size, terms, kernels)
