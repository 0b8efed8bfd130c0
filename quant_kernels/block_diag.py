"""Block-diagonal multiplies as strided batched GEMMs, with no permute copies.

``x [T, nb*b]`` viewed as ``[T, nb, b]`` and transposed to ``[nb, T, b]`` is already a valid
strided-batched matrix layout (unit stride along ``b``, leading dimension ``nb*b``, batch stride
``b``), so ``torch.bmm`` can read it and write the output in place through the same kind of view:
the ``[nb, T, b]`` ↔ ``[T, nb, b]`` copies that ``einsum`` makes around its ``bmm`` disappear.
The plain ``einsum`` in :func:`quant_kernels.reference.block_diag_matmul` stays the oracle.
"""

from __future__ import annotations

import torch


def _as_blocks(x: torch.Tensor, nb: int, b: int) -> torch.Tensor:
    """``x [..., nb*b]`` → ``[T, nb, b]`` (a view when ``x`` is contiguous)."""
    if x.shape[-1] != nb * b:
        raise ValueError(f"last dim {x.shape[-1]} of x must equal nb*b = {nb}*{b}")
    return x.reshape(-1, nb, b)


def block_diag_matmul_nograd(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``x @ BD(G)ᵀ`` without autograd: one ``bmm`` on strided views, output written in place.

    Args:
        x: ``[..., nb*b]``, same dtype and device as ``g``.
        g: ``[nb, b, b]``.

    Returns:
        ``[..., nb*b]`` contiguous, block ``i`` = ``x_i @ G[i]ᵀ``.

    Raises:
        ValueError: ``x``'s last dim is not ``nb*b``.
    """
    nb, b, _ = g.shape
    xb = _as_blocks(x, nb, b)
    if torch.compiler.is_compiling():  # the same bmm; a strided out= cannot be traced
        out = torch.bmm(xb.transpose(0, 1), g.transpose(1, 2)).transpose(0, 1).contiguous()
        return out.view(*x.shape[:-1], nb * b)
    out = torch.empty_like(xb, memory_format=torch.contiguous_format)
    torch.bmm(xb.transpose(0, 1), g.transpose(1, 2), out=out.transpose(0, 1))
    return out.view(*x.shape[:-1], nb * b)


def block_diag_grad(d_out: torch.Tensor, inp: torch.Tensor, nb: int, b: int) -> torch.Tensor:
    """Gradient of ``out = inp @ BD(G)ᵀ`` with respect to ``G``: ``Σ_t d_out_kᵀ ⊗ inp_k``.

    Args:
        d_out: ``[..., nb*b]`` gradient of the output.
        inp: ``[..., nb*b]`` the input (same leading shape and dtype).

    Returns:
        ``[nb, b, b]``; entry ``[k, d, c] = Σ_t d_out[t, k*b + d] · inp[t, k*b + c]``.
    """
    do = _as_blocks(d_out, nb, b).transpose(0, 1)  # [nb, T, b]
    xi = _as_blocks(inp, nb, b).transpose(0, 1)  # [nb, T, b]
    return torch.bmm(do.transpose(1, 2), xi)


class _BlockDiagMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, g)
        return block_diag_matmul_nograd(x, g)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):  # type: ignore[override]
        x, g = ctx.saved_tensors
        nb, b, _ = g.shape
        d_out = d_out.contiguous()
        dx = block_diag_matmul_nograd(d_out, g.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        dg = block_diag_grad(d_out, x, nb, b) if ctx.needs_input_grad[1] else None
        return dx, dg


def block_diag_matmul(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Differentiable ``x @ BD(G)ᵀ`` (``x [..., nb*b]``, ``g [nb, b, b]``, same dtype).

    Equal to :func:`quant_kernels.reference.block_diag_matmul`, without its permute copies.
    """
    if torch.is_grad_enabled() and (x.requires_grad or g.requires_grad):
        return _BlockDiagMatmul.apply(x, g)
    return block_diag_matmul_nograd(x, g)
