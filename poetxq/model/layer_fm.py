"""The POET-X(Q) layer's feature-major path (the default on a GPU for non-ragged sides).

The activations stay ``[dim, T]`` between the layer's two permutations, each of which also
changes the layout in one coalesced pass (:mod:`quant_kernels.transpose_perm`); the block
multiplies are ``bmm``s over ``[nb, b, T]`` views and the weight GEMMs multiply feature-major
(``FrozenWeight.matmul_fm`` / ``matmul_t_fm`` / ``backward_fm`` under the layer's policy).
Timings: ``docs/KERNELS.md`` (Layer layout). :mod:`poetxq.model.layer` chooses
between this path and its row-major autograd one (``_feature_major``); the ``mem`` Function and
the SwiGLU down projection's Function (both variants) live there, the ``fast`` one here. The
torch path of :mod:`poetxq.model.layer` is the oracle of every function below.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

import quant_kernels
from poetxq.model.orthogonal import OrthogonalSide
from poetxq.model.store import FrozenStore


def forward_fm(
    x: torch.Tensor,
    g_p: torch.Tensor,
    g_r: torch.Tensor,
    frozen: FrozenStore,
    side_p: OrthogonalSide,
    side_r: OrthogonalSide,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`poetxq.model.layer._forward_autograd` without autograd, feature-major (``[dim, T]``)
    between its two permutations, each of which also changes the layout in one coalesced pass
    (:mod:`quant_kernels.transpose_perm`; timings in ``docs/KERNELS.md``, Layer layout).

    ``x`` may come in another dtype than the blocks ``g_p`` (the compute dtype): the first
    permutation casts it (the policy's ``fused_input_cast``).

    Returns:
        ``(y [..., m], x'ᵀ [n, T], hᵀ = W' zᵀ [m, T])``: the output and what the ``fast``
        variant keeps for backward, in ``g_p``'s dtype.
    """
    x2 = x.reshape(-1, side_p.dim)
    t = x2.shape[0]
    # x'ᵀ = x[..., Ψ_n]ᵀ, in the compute dtype
    xpt = quant_kernels.permute_to_feature_major(x2, side_p.inv_perm, out_dtype=g_p.dtype)
    zt = torch.bmm(g_p, xpt.view(side_p.nb, side_p.block_size, t)).view(side_p.dim, t)
    ht = frozen.matmul_fm(zt)  # W' zᵀ
    del zt
    ut = torch.bmm(g_r, ht.view(side_r.nb, side_r.block_size, t)).view(side_r.dim, t)
    y = quant_kernels.permute_to_row_major(ut, side_r.inv_perm)  # y = u[..., inv_perm_R]
    return y.view(*x.shape[:-1], side_r.dim), xpt, ht


def _block_grad_rows(
    du_blocks: torch.Tensor, dg: torch.Tensor, row0: int, ht_rows: torch.Tensor
) -> None:
    """``dg[k] = du_k h_kᵀ`` for the blocks ``k`` that the rows ``row0 …`` of ``hᵀ`` cover
    (``du_blocks [nb, b, T]``, ``ht_rows [c·b, T]``, ``dg [nb, b, b]`` written in place)."""
    _, b, t = du_blocks.shape
    k0, kc = row0 // b, ht_rows.shape[0] // b
    hb = ht_rows.view(kc, b, t).transpose(1, 2)
    torch.bmm(du_blocks[k0 : k0 + kc], hb, out=dg[k0 : k0 + kc])


def mem_backward_fm(
    x: torch.Tensor,
    dy: torch.Tensor,
    g_p: torch.Tensor,
    g_r: torch.Tensor,
    frozen: FrozenStore,
    sp: OrthogonalSide,
    sr: OrthogonalSide,
    needs: tuple[bool, ...],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """:func:`poetxq.model.layer._mem_backward` feature-major (see :func:`forward_fm`): four
    permutations, each fused with a layout change, instead of five gathers."""
    kern = quant_kernels
    n, m, t, b_r = sp.dim, sr.dim, x.numel() // sp.dim, sr.block_size
    xpt = kern.permute_to_feature_major(x.reshape(t, n), sp.inv_perm, out_dtype=g_p.dtype)
    dut = kern.permute_to_feature_major(dy.reshape(t, m), sr.inv_perm)  # du = dy[..., Ψ_m]
    du_blocks = dut.view(sr.nb, b_r, t)
    dht = torch.bmm(g_r.transpose(1, 2), du_blocks).view(m, t)  # dhᵀ (needs no h)
    dg_r = None
    if needs[2]:  # dG_R = du hᵀ per block, from h = W' z recomputed band by band
        dg_r = dut.new_empty(sr.nb, b_r, b_r)
        zt = torch.bmm(g_p, xpt.view(sp.nb, sp.block_size, t)).view(n, t)
        on_rows = functools.partial(_block_grad_rows, du_blocks, dg_r)
        dzt = frozen.backward_fm(zt, dht, b_r, on_rows)  # W'ᵀ dhᵀ, h recomputed alongside
        del zt, on_rows
    else:  # G_R frozen: h is not needed at all
        dzt = frozen.matmul_t_fm(dht)
    del dut, du_blocks, dht
    return (*_input_side_backward_fm(dzt, xpt, g_p, sp, needs, x.shape, x.dtype), dg_r)


def _input_side_backward_fm(
    dzt: torch.Tensor,
    xpt: torch.Tensor,
    g_p: torch.Tensor,
    sp: OrthogonalSide,
    needs: tuple[bool, ...],
    x_shape: torch.Size,
    x_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dG_P)`` of a feature-major backward from ``dzᵀ [n, T]`` and ``x'ᵀ [n, T]``:
    ``dG_P = dz x'ᵀ`` per block and ``dx = (dz @ BD(G_P))[..., inv_perm_P]`` (``x_shape``,
    ``x_dtype``: cast in the last permutation), None where ``needs[1]`` / ``needs[0]`` is
    False."""
    t = dzt.shape[1]
    dz_blocks = dzt.view(sp.nb, sp.block_size, t)
    dg_p = (
        torch.bmm(dz_blocks, xpt.view(sp.nb, sp.block_size, t).transpose(1, 2))
        if needs[1]
        else None
    )
    dx = None
    if needs[0]:
        dxpt = torch.bmm(g_p.transpose(1, 2), dz_blocks).view(sp.dim, t)
        dx = quant_kernels.permute_to_row_major(dxpt, sp.inv_perm, out_dtype=x_dtype)
        dx = dx.view(x_shape)
    return dx, dg_p


class POETXFastFmFn(torch.autograd.Function):
    """The ``fast`` variant feature-major: the forward of :func:`forward_fm`, keeping the
    permuted input ``x'ᵀ [n, T]`` and the GEMM output ``hᵀ = W' zᵀ [m, T]`` for backward (what
    the autograd ``fast`` path keeps, there row-major), so ``dG_R`` comes from ``hᵀ`` and the
    backward runs one weight GEMM (dX) where ``mem`` runs two (the recompute and dX). Five
    permutations, each fused with a layout change (:mod:`quant_kernels.transpose_perm`), replace
    the autograd path's five ``index_select`` gathers (and their scatter-free gather
    backwards)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        frozen: FrozenStore,
        sp: OrthogonalSide,
        sr: OrthogonalSide,
    ) -> torch.Tensor:
        y, xpt, ht = forward_fm(x, g_p, g_r, frozen, sp, sr)
        ctx.save_for_backward(xpt, ht, g_p, g_r)
        ctx.frozen, ctx.sp, ctx.sr, ctx.x_shape, ctx.x_dtype = frozen, sp, sr, x.shape, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        xpt, ht, g_p, g_r = ctx.saved_tensors
        kept = (xpt, ctx.x_shape, ctx.x_dtype)
        needs = ctx.needs_input_grad[:3]
        dx, dg_p, dg_r = fast_backward_fm(
            dy, ht, g_p, g_r, ctx.frozen, ctx.sp, ctx.sr, needs, lambda: kept
        )
        return dx, dg_p, dg_r, None, None, None


def fast_backward_fm(
    dy: torch.Tensor,
    ht: torch.Tensor,
    g_p: torch.Tensor,
    g_r: torch.Tensor,
    frozen: FrozenStore,
    sp: OrthogonalSide,
    sr: OrthogonalSide,
    needs: tuple[bool, ...],
    permuted_input: Callable[[], tuple[torch.Tensor, torch.Size, torch.dtype]],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Backward of the ``fast`` feature-major forward (:func:`forward_fm`) from ``dy`` and the
    kept GEMM output ``hᵀ [m, T]``: ``(dx, dG_P, dG_R)``, None where ``needs`` is False.

    ``permuted_input()`` gives ``(x'ᵀ [n, T], x.shape, x.dtype)`` of the layer's input; it is
    called only when ``dx`` or ``dG_P`` is needed (so a caller may recompute ``x'ᵀ`` there)."""
    dzt, dg_r = _output_side_backward_fm(dy, ht, g_r, frozen, sr, needs[2])
    if not (needs[0] or needs[1]):
        return None, None, dg_r
    xpt, x_shape, x_dtype = permuted_input()
    return (*_input_side_backward_fm(dzt, xpt, g_p, sp, needs, x_shape, x_dtype), dg_r)


def _output_side_backward_fm(
    dy: torch.Tensor,
    ht: torch.Tensor,
    g_r: torch.Tensor,
    frozen: FrozenStore,
    sr: OrthogonalSide,
    needs_r: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dzᵀ [n, T], dG_R)`` of a ``fast`` feature-major backward from ``dy [..., m]`` and the
    kept GEMM output ``hᵀ [m, T]``: ``du = dy[..., Ψ_m]``, ``dG_R = du hᵀ`` per block (None
    unless ``needs_r``), ``dhᵀ = BD(G_R)ᵀ duᵀ`` and the dX GEMM ``dzᵀ = W'ᵀ dhᵀ``; all in
    ``hᵀ``'s dtype."""
    t = ht.shape[1]
    dy = dy.to(ht.dtype).reshape(t, sr.dim)
    du_blocks = quant_kernels.permute_to_feature_major(dy, sr.inv_perm).view(
        sr.nb, sr.block_size, t
    )  # du = dy[..., Ψ_m]
    dg_r = (
        torch.bmm(du_blocks, ht.view(sr.nb, sr.block_size, t).transpose(1, 2)) if needs_r else None
    )
    dht = torch.bmm(g_r.transpose(1, 2), du_blocks).view(sr.dim, t)
    del du_blocks
    return frozen.matmul_t_fm(dht), dg_r
