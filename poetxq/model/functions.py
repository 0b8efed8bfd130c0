"""The autograd Functions of the POET-X(Q) layer and of the frozen low-bit linear.

* :class:`FrozenMatmul` — ``z @ W'ᵀ`` against a frozen store, differentiable in ``z`` only
  (``dz = dh @ W'``): the row-major layer's GEMM and :class:`poetxq.model.layer.FrozenLinear`.
* :class:`POETXMemFn` — the ``mem`` variant: saves the layer input ``x`` and the blocks only and
  recomputes ``x'``, ``z`` and ``h`` in backward (3 big GEMMs per step, no ``[N, m]``
  activation kept).
* :class:`POETXFastFmFn` — the ``fast`` variant feature-major: keeps ``x'ᵀ`` and ``hᵀ`` (2 big
  GEMMs per step). Row-major, ``fast`` is plain autograd over
  :meth:`poetxq.model.layout.RowMajor.forward`.
* :class:`SwiGLUDownFn` — a Llama down projection ``down(SiLU(gate) · up)`` that saves ``gate``
  and ``up`` instead of its input.

Each Function is handed the :class:`~poetxq.model.layout.Layout` its call runs in (chosen once
per call by the layer's :class:`~poetxq.model.layout.LayoutChoice`) and the
:class:`~poetxq.model.store.FrozenStore` (and so the kernel policy) of its forward, and keeps
both for its backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

import quant_kernels

if TYPE_CHECKING:
    from poetxq.model.layout import FeatureMajor, Layout
    from poetxq.model.orthogonal import OrthogonalSide
    from poetxq.model.store import FrozenStore
    from poetxq.model.swiglu import SwiGLUMaps


class FrozenMatmul(torch.autograd.Function):
    """``z @ W'ᵀ`` (``z [..., n]`` → ``[..., m]``) through ``store``, which has ``matmul`` and
    ``matmul_t`` (a :class:`~poetxq.model.store.FrozenStore`); backward is ``dh @ W'`` only (no
    weight gradient)."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, store: FrozenStore) -> torch.Tensor:  # type: ignore[override]
        ctx.store = store
        return store.matmul(z)

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return ctx.store.matmul_t(dh), None


class POETXMemFn(torch.autograd.Function):
    """The ``mem`` variant: saves ``x``, ``G_P``, ``G_R`` only; ``layout`` recomputes the GEMM
    in backward (:meth:`~poetxq.model.layout.Layout.mem_backward`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        store: FrozenStore,
        side_p: OrthogonalSide,
        side_r: OrthogonalSide,
        layout: Layout,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, g_p, g_r)
        ctx.store, ctx.side_p, ctx.side_r, ctx.layout = store, side_p, side_r, layout
        return layout.forward(x, g_p, g_r, store, side_p, side_r)[0]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x, g_p, g_r = ctx.saved_tensors
        dy = dy.to(g_p.dtype)  # the compute dtype (x may be wider: KernelPolicy.fused_input_cast)
        dx, dg_p, dg_r = ctx.layout.mem_backward(
            x, dy, g_p, g_r, ctx.store, ctx.side_p, ctx.side_r, ctx.needs_input_grad[:3]
        )
        return dx, dg_p, dg_r, None, None, None, None


class POETXFastFmFn(torch.autograd.Function):
    """The ``fast`` variant feature-major: the forward of
    :meth:`~poetxq.model.layout.FeatureMajor.forward`, keeping the permuted input
    ``x'ᵀ [n, T]`` and the GEMM output ``hᵀ = W' zᵀ [m, T]`` for backward (what the autograd
    ``fast`` path keeps, there row-major), so ``dG_R`` comes from ``hᵀ`` and the backward runs
    one weight GEMM (dX) where ``mem`` runs two (the recompute and dX). Five permutations, each
    fused with a layout change, replace the autograd path's five ``index_select`` gathers."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        store: FrozenStore,
        sp: OrthogonalSide,
        sr: OrthogonalSide,
        layout: FeatureMajor,
    ) -> torch.Tensor:
        y, (xpt, ht) = layout.forward(x, g_p, g_r, store, sp, sr)
        ctx.save_for_backward(xpt, ht, g_p, g_r)
        ctx.store, ctx.sp, ctx.sr, ctx.layout = store, sp, sr, layout
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        xpt, ht, g_p, g_r = ctx.saved_tensors
        kept = (xpt, ctx.x_shape, ctx.x_dtype)
        needs = ctx.needs_input_grad[:3]
        dx, dg_p, dg_r = ctx.layout.fast_backward(
            dy, ht, g_p, g_r, ctx.store, ctx.sp, ctx.sr, needs, lambda: kept
        )
        return dx, dg_p, dg_r, None, None, None, None


class SwiGLUDownFn(torch.autograd.Function):
    """``down(SiLU(gate) · up)`` saving ``gate`` and ``up`` (and, with ``keep_h``, the ``fast``
    variant's feature-major GEMM output ``hᵀ [m, T]``) instead of the down projection's input.

    The product ``SiLU(gate) · up`` and ``SiLU(gate)`` are recomputed in backward (elementwise,
    by the MLP's :class:`~poetxq.model.swiglu.SwiGLUMaps`) instead of being kept as two more
    ``[T, f]`` tensors (with ``keep_h``: ``SiLU(gate)`` and the permuted input ``x'ᵀ``). The down
    projection's backward is ``layout``'s ``mem`` one or, with ``keep_h`` (``layout`` then
    feature-major), :meth:`~poetxq.model.layout.FeatureMajor.fast_backward`, which spares the
    GEMM recompute.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        gate: torch.Tensor,
        up: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        store: FrozenStore,
        side_p: OrthogonalSide,
        side_r: OrthogonalSide,
        layout: Layout,
        keep_h: bool,
        maps: SwiGLUMaps,
    ) -> torch.Tensor:
        x = maps.forward(gate, up)
        y, kept = layout.forward(x, g_p, g_r, store, side_p, side_r)
        del x
        kept = kept[1:] if keep_h else ()  # only hᵀ: backward recomputes x'ᵀ from gate, up
        ctx.save_for_backward(gate, up, g_p, g_r, *kept)
        ctx.store, ctx.side_p, ctx.side_r = store, side_p, side_r
        ctx.layout, ctx.maps = layout, maps
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        gate, up, g_p, g_r, *kept = ctx.saved_tensors
        sp, sr, layout, maps = ctx.side_p, ctx.side_r, ctx.layout, ctx.maps
        needs = (any(ctx.needs_input_grad[:2]), *ctx.needs_input_grad[2:4])
        if kept:

            def permuted_input() -> tuple[torch.Tensor, torch.Size, torch.dtype]:
                x = maps.forward(gate, up)
                xpt = quant_kernels.permute_to_feature_major(
                    x.reshape(-1, sp.dim), sp.inv_perm, out_dtype=g_p.dtype
                )
                return xpt, x.shape, x.dtype

            dx, dg_p, dg_r = layout.fast_backward(
                dy, kept[0], g_p, g_r, ctx.store, sp, sr, needs, permuted_input
            )
        else:
            x = maps.forward(gate, up)
            dx, dg_p, dg_r = layout.mem_backward(
                x, dy.to(g_p.dtype), g_p, g_r, ctx.store, sp, sr, needs
            )
            del x
        d_gate = d_up = None
        if dx is not None:
            d_gate, d_up = maps.grads(gate, up, dx)
        return d_gate, d_up, dg_p, dg_r, None, None, None, None, None, None
