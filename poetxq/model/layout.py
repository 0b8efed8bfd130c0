"""The two layouts of a POET-X(Q) layer's computation, and the layer's choice between them.

* :data:`ROW_MAJOR` (:class:`RowMajor`): activations stay ``[..., features]``; the permutations
  are gathers and the block multiplies :func:`quant_kernels.block_diag_matmul`, all autograd
  ops. The CPU path, the fallback for ragged sides and non-Triton dtypes, and the oracle of the
  other layout.
* :data:`FEATURE_MAJOR` (:class:`FeatureMajor`): between its two permutations the layer keeps
  activations ``[features, T]``; each permutation also changes the layout in one coalesced pass
  (:mod:`quant_kernels.transpose_perm`), the block multiplies are ``bmm``\\ s over
  ``[nb, b, T]`` views and the weight GEMMs multiply feature-major. Timings:
  ``docs/KERNELS.md`` (Layer layout).

A layer builds its :class:`LayoutChoice` once (from its kernel policy and whether a side is
ragged) and asks it once per call which layout serves the input at hand; the autograd
Functions (:mod:`poetxq.model.functions`) keep that :class:`Layout` object, so a backward runs
in the layout its forward ran in. Every function of :class:`FeatureMajor` equals its
:class:`RowMajor` counterpart (``tests/test_layout.py``).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import quant_kernels
from poetxq.model.functions import FrozenMatmul
from poetxq.model.orthogonal import OrthogonalSide
from poetxq.model.store import FrozenStore
from quant_kernels.policy import KernelPolicy

#: ``(dx, dG_P, dG_R)`` of a backward, None where not needed
Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def pad_last(t: torch.Tensor, size: int) -> torch.Tensor:
    """``t [..., d]`` zero-padded to ``[..., size]`` (``size ≥ d``; ``t`` itself when equal):
    a ragged side's last block."""
    d = t.shape[-1]
    return t if d == size else F.pad(t, (0, size - d))


class Layout(abc.ABC):
    """How a layer lays out its activations between the two permutations (module docstring).

    ``forward`` computes ``y [..., m]`` from ``x [..., n]`` (in the blocks' compute dtype, or,
    on the feature-major path, wider: :attr:`KernelPolicy.fused_input_cast`) and returns it with
    what a ``fast`` backward of this layout keeps (feature-major: ``x'ᵀ [n, T]`` and
    ``hᵀ = W' zᵀ [m, T]``; row-major: nothing, autograd keeps its own); ``mem_backward``
    recomputes what the ``mem`` variant did not keep and returns ``(dx, dG_P, dG_R)``, None
    where ``needs`` (for ``x``, ``G_P``, ``G_R``) is False. ``dy`` comes in the compute dtype.
    """

    #: whether activations run ``[features, T]`` (the ``fast`` Function exists only for it)
    feature_major: bool = False

    @abc.abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        store: FrozenStore,
        sp: OrthogonalSide,
        sr: OrthogonalSide,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(y [..., m], kept)`` of the layer for ``x [..., n]``."""

    @abc.abstractmethod
    def mem_backward(
        self,
        x: torch.Tensor,
        dy: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        store: FrozenStore,
        sp: OrthogonalSide,
        sr: OrthogonalSide,
        needs: tuple[bool, ...],
    ) -> Grads:
        """``(dx, dG_P, dG_R)`` of the ``mem`` variant from its saved input ``x``."""

    def __repr__(self) -> str:
        return type(self).__name__


class RowMajor(Layout):
    """The row-major layout, from autograd ops (module docstring)."""

    def forward(
        self,
        x: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        store: FrozenStore,
        sp: OrthogonalSide,
        sr: OrthogonalSide,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(y, ())`` by autograd ops: differentiable in ``x``, ``g_p`` and ``g_r`` (the
        ``fast`` variant's training path: autograd keeps ``x'`` and ``h``), plain without
        grad."""
        n, m = sp.dim, sr.dim
        xp = pad_last(quant_kernels.permute_last(x, sp.perm, sp.inv_perm), sp.padded_dim)
        z = quant_kernels.block_diag_matmul(xp, g_p)[..., :n]
        h = FrozenMatmul.apply(z, store)
        u = quant_kernels.block_diag_matmul(pad_last(h, sr.padded_dim), g_r)[..., :m]
        return quant_kernels.permute_last(u, sr.inv_perm, sr.perm), ()

    def mem_backward(
        self,
        x: torch.Tensor,
        dy: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        store: FrozenStore,
        sp: OrthogonalSide,
        sr: OrthogonalSide,
        needs: tuple[bool, ...],
    ) -> Grads:
        """Backward of the ``mem`` forward from its saved input, recomputing ``x'``, ``z`` and
        ``h``."""
        n, m, b_p, b_r = sp.dim, sr.dim, sp.block_size, sr.block_size
        xp = pad_last(quant_kernels.permute_last(x, sp.perm), sp.padded_dim)
        z = quant_kernels.block_diag_matmul(xp, g_p)
        h = pad_last(store.matmul(z[..., :n]), sr.padded_dim)
        # y = u[..., inv_perm_R]  =>  du = dy[..., perm_R]
        du = pad_last(quant_kernels.permute_last(dy, sr.perm), sr.padded_dim)
        grad = quant_kernels.block_diag_grad
        dg_r = grad(du, h, sr.nb, b_r) if needs[2] else None
        del h
        dh = quant_kernels.block_diag_matmul(du, g_r.transpose(1, 2))[..., :m]
        dz = pad_last(store.matmul_t(dh), sp.padded_dim)
        dg_p = grad(dz, xp, sp.nb, b_p) if needs[1] else None
        dx = None
        if needs[0]:
            dxp = quant_kernels.block_diag_matmul(dz, g_p.transpose(1, 2))[..., :n]
            dx = quant_kernels.permute_last(dxp, sp.inv_perm)
        return dx, dg_p, dg_r


class FeatureMajor(Layout):
    """The feature-major layout (module docstring); no side may be ragged. Nothing here
    builds an autograd graph: :mod:`poetxq.model.functions` wraps it."""

    feature_major = True

    def forward(
        self,
        x: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        store: FrozenStore,
        sp: OrthogonalSide,
        sr: OrthogonalSide,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(y [..., m], (x'ᵀ [n, T], hᵀ = W' zᵀ [m, T]))``: the output and what the ``fast``
        variant keeps for backward, in ``g_p``'s dtype (``x`` may come wider: the first
        permutation casts it)."""
        t = x.numel() // sp.dim
        # x'ᵀ = x[..., Ψ_n]ᵀ, in the compute dtype
        xpt = quant_kernels.permute_to_feature_major(
            x.reshape(t, sp.dim), sp.inv_perm, out_dtype=g_p.dtype
        )
        zt = torch.bmm(g_p, xpt.view(sp.nb, sp.block_size, t)).view(sp.dim, t)
        ht = store.matmul_fm(zt)  # W' zᵀ
        del zt
        ut = torch.bmm(g_r, ht.view(sr.nb, sr.block_size, t)).view(sr.dim, t)
        y = quant_kernels.permute_to_row_major(ut, sr.inv_perm)  # y = u[..., inv_perm_R]
        return y.view(*x.shape[:-1], sr.dim), (xpt, ht)

    def mem_backward(
        self,
        x: torch.Tensor,
        dy: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        store: FrozenStore,
        sp: OrthogonalSide,
        sr: OrthogonalSide,
        needs: tuple[bool, ...],
    ) -> Grads:
        """Four permutations, each fused with a layout change, instead of the row-major path's
        five gathers; ``h`` recomputed band by band beside the dX GEMM."""
        n, m, t, b_r = sp.dim, sr.dim, x.numel() // sp.dim, sr.block_size
        xpt = quant_kernels.permute_to_feature_major(
            x.reshape(t, n), sp.inv_perm, out_dtype=g_p.dtype
        )
        # du = dy[..., Ψ_m]
        dut = quant_kernels.permute_to_feature_major(dy.reshape(t, m), sr.inv_perm)
        du_blocks = dut.view(sr.nb, b_r, t)
        dht = torch.bmm(g_r.transpose(1, 2), du_blocks).view(m, t)  # dhᵀ (needs no h)
        dg_r = None
        if needs[2]:  # dG_R = du hᵀ per block, from h = W' z recomputed band by band
            dg_r = dut.new_empty(sr.nb, b_r, b_r)
            zt = torch.bmm(g_p, xpt.view(sp.nb, sp.block_size, t)).view(n, t)
            on_rows = functools.partial(_block_grad_rows, du_blocks, dg_r)
            dzt = store.backward_fm(zt, dht, b_r, on_rows)  # W'ᵀ dhᵀ, h recomputed alongside
            del zt, on_rows
        else:  # G_R frozen: h is not needed at all
            dzt = store.matmul_t_fm(dht)
        del dut, du_blocks, dht
        return (*_input_side_backward(dzt, xpt, g_p, sp, needs, x.shape, x.dtype), dg_r)

    def fast_backward(
        self,
        dy: torch.Tensor,
        ht: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        store: FrozenStore,
        sp: OrthogonalSide,
        sr: OrthogonalSide,
        needs: tuple[bool, ...],
        permuted_input: Callable[[], tuple[torch.Tensor, torch.Size, torch.dtype]],
    ) -> Grads:
        """Backward of :meth:`forward` from ``dy`` and the kept GEMM output ``hᵀ [m, T]``
        (one weight GEMM, the dX one: ``dG_R`` comes from ``hᵀ``).

        ``permuted_input()`` gives ``(x'ᵀ [n, T], x.shape, x.dtype)`` of the layer's input; it
        is called only when ``dx`` or ``dG_P`` is needed (so a caller may recompute ``x'ᵀ``)."""
        dzt, dg_r = _output_side_backward(dy, ht, g_r, store, sr, needs[2])
        if not (needs[0] or needs[1]):
            return None, None, dg_r
        xpt, x_shape, x_dtype = permuted_input()
        return (*_input_side_backward(dzt, xpt, g_p, sp, needs, x_shape, x_dtype), dg_r)


def _block_grad_rows(
    du_blocks: torch.Tensor, dg: torch.Tensor, row0: int, ht_rows: torch.Tensor
) -> None:
    """``dg[k] = du_k h_kᵀ`` for the blocks ``k`` that the rows ``row0 …`` of ``hᵀ`` cover
    (``du_blocks [nb, b, T]``, ``ht_rows [c·b, T]``, ``dg [nb, b, b]`` written in place)."""
    _, b, t = du_blocks.shape
    k0, kc = row0 // b, ht_rows.shape[0] // b
    hb = ht_rows.view(kc, b, t).transpose(1, 2)
    torch.bmm(du_blocks[k0 : k0 + kc], hb, out=dg[k0 : k0 + kc])


def _input_side_backward(
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


def _output_side_backward(
    dy: torch.Tensor,
    ht: torch.Tensor,
    g_r: torch.Tensor,
    store: FrozenStore,
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
    return store.matmul_t_fm(dht), dg_r


ROW_MAJOR = RowMajor()
FEATURE_MAJOR = FeatureMajor()


@dataclass(frozen=True)
class LayoutChoice:
    """A layer's choice of :class:`Layout`, built with the layer (and again by
    ``POETXLinear.use_kernels``).

    What is known at build is fixed here: the kernel policy, and whether a side is ragged (then
    every call is row-major). What depends on the input — a CUDA tensor (or the policy's
    ``interpret_on_cpu``) and a Triton dtype — is asked once per call, by :meth:`for_call` or
    :meth:`for_swiglu`; the layer hands the answer to its autograd Function.

    Attributes:
        kernels: the layer's kernel policy.
        ragged: whether ``b`` fails to divide ``n`` or ``m``.
    """

    kernels: KernelPolicy
    ragged: bool

    def _feature_major(
        self, x: torch.Tensor, *, fast: bool, dtype: torch.dtype | None = None
    ) -> bool:
        return not self.ragged and self.kernels.feature_major_for(x, fast=fast, dtype=dtype)

    def for_call(
        self, x: torch.Tensor, compute_dtype: torch.dtype, *, fast_training: bool
    ) -> tuple[Layout, bool]:
        """``(layout, cast_inside)`` of a call on ``x``: the layout that serves ``x`` once in
        ``compute_dtype`` (``fast_training``: the ``fast`` variant under grad, which asks the
        policy's ``fast_feature_major``), and whether the layer passes ``x`` uncast for the
        first permutation to cast (the policy's ``fused_input_cast``; only when every path the
        call can take is feature-major)."""
        cast_inside = (
            self.kernels.fused_input_cast_for(x, compute_dtype)
            and self._feature_major(x, fast=False)
            and (not fast_training or self._feature_major(x, fast=True))
        )
        if cast_inside:
            return FEATURE_MAJOR, True
        fm = self._feature_major(x, fast=fast_training, dtype=compute_dtype)
        return (FEATURE_MAJOR if fm else ROW_MAJOR), False

    def for_swiglu(
        self, gate: torch.Tensor, compute_dtype: torch.dtype, *, fast: bool
    ) -> Layout | None:
        """The layout of a fused SwiGLU down projection (``POETXLinear.forward_swiglu``) whose
        gate is ``gate``: ``mem`` (``fast`` False) runs either layout; the ``fast`` variant only
        feature-major with the policy's ``lean_fast_swiglu`` — None: the plain composition."""
        if fast:
            lean = self.kernels.lean_fast_swiglu_for(gate)
            return FEATURE_MAJOR if lean and self._feature_major(gate, fast=True) else None
        fm = self._feature_major(gate, fast=False, dtype=compute_dtype)
        return FEATURE_MAJOR if fm else ROW_MAJOR
