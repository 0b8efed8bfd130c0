# Over 500 lines: the layer, its autograd Functions (mem / fast, SwiGLU down) and its merge share
# private helpers and the math of the module docstring; split, they would import each other.
"""The POET-X(Q) linear layer: ``y = x @ (R · W0 · P)ᵀ`` computed input-centric.

Math (POET-X, arXiv 2603.05500). With ``R = Ψ_mᵀ BD(G_R) Ψ_m`` and
``P = Ψ_nᵀ BD(G_P) Ψ_n`` and the permutations merged into the stored weight
``W' = Ψ_m W0 Ψ_nᵀ``, a forward is::

    x' = x[..., perm_P]                  # gather by the input permutation   [.., n]
    z  = x' @ BD(G_P)ᵀ                   # batched b×b block matmuls         [.., n]
    h  = z @ W'ᵀ                         # the one big GEMM (W' frozen, low-bit) [.., m]
    u  = h @ BD(G_R)ᵀ                    # batched block matmuls             [.., m]
    y  = u[..., inv_perm_R]              # gather by the inverse output permutation

4-bit stores keep the columns in input order, ``W'' = Ψ_m W0``, and gather ``z`` back by
``Ψ_nᵀ`` before the GEMM (:class:`FrozenStore`): their 64-blocks then never regroup at merges.

The dense ``m×m`` / ``n×n`` factors and ``R·W0·P`` are never built in the training path. ``W'`` has
no gradient; backward needs one GEMM for dX (``dz = dh @ W'``) and the small block gradients.

Variants:
* ``fast`` keeps the GEMM output ``h`` ``[N, m]`` (and ``x'``) for backward: 2 big GEMMs per step.
* ``mem`` saves only the layer input ``x`` and recomputes ``x'``, ``z`` and ``h`` in backward, in
  its own autograd Function: 3 big GEMMs per step, no ``[N, m]`` activation kept. POET-XQ uses mem.

On a GPU both variants run feature-major between their two permutations
(:mod:`poetxq.model.layer_fm`) when no side is ragged and the compute dtype is one Triton takes
(fp32, bf16, fp16); this module holds the row-major path, which is the CPU path, the fallback and
the oracle, and chooses between the two (``_feature_major``).

Every kernel choice comes from the layer's :class:`~quant_kernels.policy.KernelPolicy`, fixed
when the layer is built (``kernels``, default :func:`quant_kernels.policy.default_policy`). The
autograd Functions keep the store they ran with, policy included, so a backward always takes the
path its forward took.

``merge_then_reinitialize()`` folds ``R`` and ``P`` into the stored weight (in fp32, then
re-quantized), draws new permutations and resets ``Q`` to zero; the layer's function is unchanged
(up to re-quantization error for low-bit stores).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

import quant_kernels
from poetxq.model.layer_fm import POETXFastFmFn, fast_backward_fm, forward_fm, mem_backward_fm
from poetxq.model.orthogonal import OrthogonalSide
from poetxq.model.quant import make_frozen_weight
from poetxq.model.store import FrozenStore
from poetxq.model.swiglu import PLAIN, SwiGLUMaps
from quant_kernels.policy import KernelPolicy, default_policy

Variant = Literal["fast", "mem"]
VARIANTS: tuple[str, ...] = ("fast", "mem")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a call on ``x`` computes in: autocast's for ``x``'s device where it is on,
    else ``x.dtype``."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _pad_to(t: torch.Tensor, size: int) -> torch.Tensor:
    d = t.shape[-1]
    return t if d == size else F.pad(t, (0, size - d))


class _FrozenMatmul(torch.autograd.Function):
    """``z @ W'ᵀ`` with a frozen store: backward is ``dh @ W'`` only (no weight gradient)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, frozen: FrozenStore) -> torch.Tensor:  # type: ignore[override]
        ctx.frozen = frozen
        return frozen.matmul(z)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):  # type: ignore[override]
        return ctx.frozen.matmul_t(dh), None


def _forward_autograd(
    x: torch.Tensor,
    g_p: torch.Tensor,
    g_r: torch.Tensor,
    frozen: FrozenStore,
    side_p: OrthogonalSide,
    side_r: OrthogonalSide,
) -> torch.Tensor:
    """Forward built from autograd ops (the ``fast`` variant; also used without grad)."""
    n, m = side_p.dim, side_r.dim
    xp = _pad_to(quant_kernels.permute_last(x, side_p.perm, side_p.inv_perm), side_p.padded_dim)
    z = quant_kernels.block_diag_matmul(xp, g_p)[..., :n]
    h = _FrozenMatmul.apply(z, frozen)
    u = quant_kernels.block_diag_matmul(_pad_to(h, side_r.padded_dim), g_r)[..., :m]
    return quant_kernels.permute_last(u, side_r.inv_perm, side_r.perm)


def _feature_major(
    x: torch.Tensor,
    frozen: FrozenStore,
    side_p: OrthogonalSide,
    side_r: OrthogonalSide,
    *,
    fast: bool = False,
) -> bool:
    """Whether the feature-major path serves this call: allowed for ``x`` by the store's policy
    (``feature_major``, or for the ``fast`` variant's training forward ``fast_feature_major``)
    and no ragged block on either side."""
    allowed = frozen.kernels.feature_major_for(x, fast=fast)
    return allowed and side_p.padded_dim == side_p.dim and side_r.padded_dim == side_r.dim


def _forward(
    x: torch.Tensor,
    g_p: torch.Tensor,
    g_r: torch.Tensor,
    frozen: FrozenStore,
    side_p: OrthogonalSide,
    side_r: OrthogonalSide,
) -> torch.Tensor:
    """The layer's forward: feature-major without grad where :func:`_feature_major` allows, else
    from autograd ops."""
    if not torch.is_grad_enabled() and _feature_major(x, frozen, side_p, side_r):
        return forward_fm(x, g_p, g_r, frozen, side_p, side_r)[0]
    return _forward_autograd(x, g_p, g_r, frozen, side_p, side_r)


class _POETXMemFn(torch.autograd.Function):
    """The ``mem`` variant: saves ``x``, ``G_P``, ``G_R`` only; recomputes the GEMM in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        frozen: FrozenStore,
        side_p: OrthogonalSide,
        side_r: OrthogonalSide,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, g_p, g_r)
        ctx.frozen, ctx.side_p, ctx.side_r = frozen, side_p, side_r
        return _forward(x, g_p, g_r, frozen, side_p, side_r)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, g_p, g_r = ctx.saved_tensors
        dx, dg_p, dg_r = _mem_backward(
            x, dy, g_p, g_r, ctx.frozen, ctx.side_p, ctx.side_r, ctx.needs_input_grad[:3]
        )
        return dx, dg_p, dg_r, None, None, None


def _mem_backward(
    x: torch.Tensor,
    dy: torch.Tensor,
    g_p: torch.Tensor,
    g_r: torch.Tensor,
    frozen: FrozenStore,
    sp: OrthogonalSide,
    sr: OrthogonalSide,
    needs: tuple[bool, ...],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Backward of the ``mem`` forward from its saved input: ``(dx, dG_P, dG_R)`` (None where
    ``needs`` is False), recomputing ``x'``, ``z`` and ``h``."""
    n, m, b_p, b_r = sp.dim, sr.dim, sp.block_size, sr.block_size
    dy = dy.to(g_p.dtype)  # the compute dtype (x may be wider: KernelPolicy.fused_input_cast)
    if _feature_major(x, frozen, sp, sr):  # as in forward: same store, same policy
        return mem_backward_fm(x, dy, g_p, g_r, frozen, sp, sr, needs)
    xp = _pad_to(quant_kernels.permute_last(x, sp.perm), sp.padded_dim)
    z = quant_kernels.block_diag_matmul(xp, g_p)
    h = _pad_to(frozen.matmul(z[..., :n]), sr.padded_dim)
    # y = u[..., inv_perm_R]  =>  du = dy[..., perm_R]
    du = _pad_to(quant_kernels.permute_last(dy, sr.perm), sr.padded_dim)
    grad = quant_kernels.block_diag_grad
    dg_r = grad(du, h, sr.nb, b_r) if needs[2] else None
    del h
    dh = quant_kernels.block_diag_matmul(du, g_r.transpose(1, 2))[..., :m]
    dz = _pad_to(frozen.matmul_t(dh), sp.padded_dim)
    dg_p = grad(dz, xp, sp.nb, b_p) if needs[1] else None
    dx = None
    if needs[0]:
        dxp = quant_kernels.block_diag_matmul(dz, g_p.transpose(1, 2))[..., :n]
        dx = quant_kernels.permute_last(dxp, sp.inv_perm)
    return dx, dg_p, dg_r


class _SwiGLUDownFn(torch.autograd.Function):
    """``down(SiLU(gate) · up)`` saving ``gate`` and ``up`` (and, on the ``fast`` variant's
    feature-major path, ``keep_h``, the GEMM output ``hᵀ [m, T]``) instead of the down
    projection's input.

    The product ``SiLU(gate) · up`` and ``SiLU(gate)`` are recomputed in backward (elementwise,
    by the MLP's :class:`~poetxq.model.swiglu.SwiGLUMaps`), instead of being kept as two more
    ``[T, f]`` tensors (with ``keep_h``: ``SiLU(gate)`` and the permuted input ``x'ᵀ``). The down
    projection's backward is the ``mem`` one (:func:`_mem_backward`) or, with ``keep_h``,
    :func:`poetxq.model.layer_fm.fast_backward_fm`, which spares the GEMM recompute.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        gate: torch.Tensor,
        up: torch.Tensor,
        g_p: torch.Tensor,
        g_r: torch.Tensor,
        frozen: FrozenStore,
        side_p: OrthogonalSide,
        side_r: OrthogonalSide,
        keep_h: bool,
        maps: SwiGLUMaps,
    ) -> torch.Tensor:
        x = maps.forward(gate, up)
        if keep_h:
            y, xpt, ht = forward_fm(x, g_p, g_r, frozen, side_p, side_r)
            del xpt
            kept: tuple[torch.Tensor, ...] = (ht,)
        else:
            y, kept = _forward(x, g_p, g_r, frozen, side_p, side_r), ()
        del x
        ctx.save_for_backward(gate, up, g_p, g_r, *kept)
        ctx.frozen, ctx.side_p, ctx.side_r, ctx.maps = frozen, side_p, side_r, maps
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        gate, up, g_p, g_r, *kept = ctx.saved_tensors
        maps: SwiGLUMaps = ctx.maps
        sp, sr = ctx.side_p, ctx.side_r
        needs = (any(ctx.needs_input_grad[:2]), *ctx.needs_input_grad[2:4])
        if kept:

            def permuted_input() -> tuple[torch.Tensor, torch.Size, torch.dtype]:
                x = maps.forward(gate, up)
                xpt = quant_kernels.permute_to_feature_major(
                    x.reshape(-1, sp.dim), sp.inv_perm, out_dtype=g_p.dtype
                )
                return xpt, x.shape, x.dtype

            dx, dg_p, dg_r = fast_backward_fm(
                dy, kept[0], g_p, g_r, ctx.frozen, sp, sr, needs, permuted_input
            )
        else:
            x = maps.forward(gate, up)
            dx, dg_p, dg_r = _mem_backward(x, dy, g_p, g_r, ctx.frozen, sp, sr, needs)
            del x
        d_gate = d_up = None
        if dx is not None:
            d_gate, d_up = maps.grads(gate, up, dx)
        return d_gate, d_up, dg_p, dg_r, None, None, None, None, None


def normalized_gaussian(
    out_features: int,
    in_features: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """POET's "normalized Gaussian" W0 ``[m, n]``: i.i.d. N(0, 1) rows scaled to unit L2 norm."""
    w = torch.randn(out_features, in_features, generator=generator, dtype=torch.float64)
    return (w / w.norm(dim=1, keepdim=True)).to(dtype)


class POETXLinear(nn.Module):
    """A linear layer trained as ``W = R · W0 · P`` with block-diagonal orthogonal ``R``, ``P``.

    Input ``x [..., n]`` → output ``[..., m]``, computed input-centric (module docstring).

    Args:
        in_features: ``n``.
        out_features: ``m``.
        block_size: ``b`` of the orthogonal blocks (``2 ≤ b ≤ min(m, n)``); ragged dims are
            padded with a masked last block (see :mod:`poetxq.model.orthogonal`).
        bits: 8 → ``W'`` stored int8 row-wise (bitsandbytes layout); 4 → NF4/FP4 blockwise
            (bitsandbytes ``Params4bit`` layout); 16 → unquantized ``W'`` in ``dtype`` (POET-X).
        quant_type: ``"nf4"`` or ``"fp4"`` (``bits=4`` only).
        double_quant: quantize the 4-bit ``absmax`` again (``bits=4`` only).
        variant: ``"mem"`` (saves only ``x``) or ``"fast"`` (keeps the GEMM output).
        neumann_terms: Neumann order ``k`` of the Cayley–Neumann parameterization.
        weight: initial ``W0`` ``[m, n]``; default: normalized Gaussian from ``generator``.
        bias: add a trainable bias (Llama projections have none).
        stochastic_requant: stochastic rounding when re-quantizing at merges.
        kernels: the kernel policy of every call of this layer (and of its two orthogonal
            sides); default :func:`quant_kernels.policy.default_policy` (``POETXQ_KERNELS``).
        structure: ``"block"`` (POET-BS: every ``b×b`` block of ``R`` and ``P`` trains) or
            ``"full"`` (POET-FS: one block per side over a random subset of ``b`` coordinates,
            drawn again at each merge; :mod:`poetxq.model.orthogonal`).
        generator: RNG for ``W0`` and the permutations.
        dtype: of ``Q`` (and of a 16-bit ``W'``); default fp32.
        device: where parameters and buffers live.

    Raises:
        ValueError: bad ``bits``, ``variant``, ``block_size`` or ``structure``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        block_size: int = 256,
        bits: int = 8,
        variant: Variant = "mem",
        neumann_terms: int = 3,
        weight: torch.Tensor | None = None,
        bias: bool = False,
        stochastic_requant: bool = False,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        quant_type: str = "nf4",
        double_quant: bool = True,
        kernels: KernelPolicy | None = None,
        structure: str = "block",
    ) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
        dtype = dtype or torch.float32
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.variant, self.block_size = bits, variant, block_size
        if weight is None:
            weight = normalized_gaussian(out_features, in_features, generator=generator)
        if tuple(weight.shape) != (out_features, in_features):
            raise ValueError(
                f"weight shape {tuple(weight.shape)} != (out, in) = ({out_features}, {in_features})"
            )
        self._kernels = default_policy() if kernels is None else kernels
        self.P = OrthogonalSide(
            in_features, block_size, neumann_terms=neumann_terms, generator=generator,
            dtype=dtype, device=device, kernels=self._kernels, structure=structure,
        )  # fmt: skip
        self.R = OrthogonalSide(
            out_features, block_size, neumann_terms=neumann_terms, generator=generator,
            dtype=dtype, device=device, kernels=self._kernels, structure=structure,
        )  # fmt: skip
        w = weight.detach().to(device=device, dtype=torch.float32 if bits in (4, 8) else dtype)
        #: 4-bit: W'' = Ψ_m W0 (columns in input order, see FrozenStore); else W' = Ψ_m W0 Ψ_nᵀ
        self.input_order_store = bits == 4
        stored = self._to_store_order(w)
        self.frozen = make_frozen_weight(
            stored, bits, stochastic=stochastic_requant, quant_type=quant_type,
            double_quant=double_quant,
        )  # fmt: skip
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        )

    def _to_store_order(self, w: torch.Tensor) -> torch.Tensor:
        """``W [m, n]`` in original coordinates → the stored order (rows, and unless
        ``input_order_store`` also columns, permuted)."""
        w = w[self.R.perm]
        return w if self.input_order_store else w[:, self.P.perm]

    @property
    def kernels(self) -> KernelPolicy:
        """The kernel policy of this layer's calls (fixed at build time; :meth:`use_kernels`)."""
        return self._kernels

    def use_kernels(self, kernels: KernelPolicy) -> None:
        """Run this layer (and its orthogonal sides) under ``kernels`` from the next forward on
        (benchmarks that time one layer on several paths; a backward keeps the policy of its
        forward). Call it before :func:`poetxq.model.blockcache.attach_block_cache`, which groups
        sides by policy."""
        self._kernels = self.P.kernels = self.R.kernels = kernels

    def _store_op(self) -> FrozenStore:
        """What the GEMMs multiply by: ``W'`` in ``P``'s permuted column order, under this
        layer's policy."""
        return FrozenStore(self.frozen, self._kernels, self.P if self.input_order_store else None)

    def stored_w0(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized frozen ``W0`` ``[m, n]`` in original coordinates (tests, drift)."""
        w = self.frozen.dequantize(dtype)[self.R.inv_perm]
        return w if self.input_order_store else w[:, self.P.inv_perm]

    def orthogonal_parameters(self) -> list[nn.Parameter]:
        """The packed skew parameters ``[Q_P, Q_R]`` (trained with ``poet_lr``)."""
        return [self.P.Q, self.R.Q]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev, cdtype = x.device.type, _compute_dtype(x)
        store = self._store_op()
        if not self._casts_inside(x, cdtype, store):
            x = x.to(cdtype)
        with torch.autocast(dev, enabled=False):  # CNP in the parameters' precision, then cast
            g_p = self.P.blocks_as(cdtype)
            g_r = self.R.blocks_as(cdtype)
            if self.variant == "mem" and torch.is_grad_enabled():
                y = _POETXMemFn.apply(x, g_p, g_r, store, self.P, self.R)
            elif torch.is_grad_enabled() and _feature_major(x, store, self.P, self.R, fast=True):
                y = POETXFastFmFn.apply(x, g_p, g_r, store, self.P, self.R)
            else:
                y = _forward(x, g_p, g_r, store, self.P, self.R)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _casts_inside(self, x: torch.Tensor, cdtype: torch.dtype, store: FrozenStore) -> bool:
        """Whether this call passes ``x`` uncast and lets the feature-major path cast it in its
        first permutation (the policy's ``fused_input_cast``): only when every path this call
        can take is feature-major (the ``fast`` training path asks its own switch)."""
        if not self._kernels.fused_input_cast_for(x, cdtype):
            return False
        fm = _feature_major(x, store, self.P, self.R)
        if self.variant == "fast" and torch.is_grad_enabled():
            fm = fm and _feature_major(x, store, self.P, self.R, fast=True)
        return fm

    def forward_swiglu(
        self, gate: torch.Tensor, up: torch.Tensor, maps: SwiGLUMaps = PLAIN
    ) -> torch.Tensor:
        """``self(SiLU(gate) · up)`` — a Llama down projection — keeping only ``gate`` and ``up``
        for backward (the ``mem`` variant), or ``gate``, ``up`` and the GEMM output (the ``fast``
        variant on its feature-major path with the policy's ``lean_fast_swiglu``);
        otherwise the plain composition.

        Args:
            gate, up: ``[..., in_features]`` outputs of the gate and up projections.
            maps: the elementwise maps the fused path runs (the calling MLP's).

        Returns:
            ``[..., out_features]``, equal to ``self(F.silu(gate) * up)``.
        """
        if self.bias is not None or not torch.is_grad_enabled():
            return self(F.silu(gate) * up)
        store = self._store_op()
        keep_h = self.variant == "fast"
        if keep_h and not (
            self._kernels.lean_fast_swiglu_for(gate)
            and _feature_major(gate, store, self.P, self.R, fast=True)
        ):
            return self(F.silu(gate) * up)
        dev, cdtype = gate.device.type, _compute_dtype(gate)
        with torch.autocast(dev, enabled=False):
            g_p = self.P.blocks_as(cdtype)
            g_r = self.R.blocks_as(cdtype)
            return _SwiGLUDownFn.apply(
                gate.to(cdtype), up.to(cdtype), g_p, g_r, store, self.P, self.R, keep_h, maps
            )

    @torch.no_grad()
    def _rotated(self) -> torch.Tensor:
        """fp32 ``M = BD(G_R) · W' · BD(G_P)`` ``[m, n]``, both sides in permuted coordinates
        (``W = Ψ_mᵀ M Ψ_n``)."""
        n, m = self.in_features, self.out_features
        g_p = self.P.blocks().to(torch.float32)
        g_r = self.R.blocks().to(torch.float32)
        w = self.frozen.dequantize(torch.float32)  # stored [m, n]; to W' (both sides permuted):
        if self.input_order_store:
            w = w[:, self.P.perm]
        # BD(G_R) · W': apply the R blocks to each column.
        w = quant_kernels.block_diag_matmul(_pad_to(w.t(), self.R.padded_dim), g_r)[..., :m].t()
        # (·) · BD(G_P): row @ BD(G_P) = row @ (BD(G_Pᵀ))ᵀ.
        w = quant_kernels.block_diag_matmul(_pad_to(w, self.P.padded_dim), g_p.transpose(1, 2))
        return w[..., :n]

    def effective_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense ``R · W0 · P`` ``[m, n]`` in original coordinates (for export, tests)."""
        # back to original coordinates: W = Ψ_mᵀ M Ψ_n
        return self._rotated()[self.R.inv_perm][:, self.P.inv_perm].to(dtype)

    @torch.no_grad()
    def merge_then_reinitialize(
        self, generator: torch.Generator | None = None, *, measure: bool = False
    ) -> float | None:
        """Fold ``R``, ``P`` into ``W'``, draw new permutations, re-store ``W'``, reset ``Q = 0``.

        The optimizer's moments of ``Q`` must be reset by the caller
        (:func:`poetxq.training.optim.reset_orthogonal_state`).

        Returns:
            With ``measure``: the re-quantization error ``‖W0_new − W‖_F / ‖W‖_F`` of the merged
            weight ``W = R·W0·P`` (fp32) against what the store now holds (0 for a 16-bit
            ``W'`` in fp32; costs one more dequantization); else None.
        """
        # M in the old permuted coordinates; the new stored order is reached from it with one
        # gather per side (the old inverse permutation composed with the new one), each freeing
        # its input: at most two fp32 [m, n] copies alive, not three (a 70B MLP weight: 0.94 GB
        # each). The same stored W0 as _to_store_order(effective_weight()) after reinitializing.
        w = self._rotated()
        old_r_inv, old_p_inv = self.R.inv_perm.clone(), self.P.inv_perm.clone()
        self.P.reinitialize(generator)
        self.R.reinitialize(generator)
        w = w[old_r_inv[self.R.perm]]
        w = w[:, old_p_inv] if self.input_order_store else w[:, old_p_inv[self.P.perm]]
        self.frozen.store(w, generator=generator)
        if not measure:
            return None
        # the relative error is the same in any order of rows and columns
        return float((self.frozen.dequantize(torch.float32) - w).norm() / w.norm())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"b={self.block_size}, bits={self.bits}, variant={self.variant}"
            + (", structure=full" if self.P.structure == "full" else "")
        )


class POETXSwiGLUMLP(nn.Module):
    """A Llama MLP ``down(SiLU(gate(x)) · up(x))`` over POET-X(Q) projections whose down
    projection keeps what :meth:`POETXLinear.forward_swiglu` keeps for backward (``mem``: only
    ``gate(x)`` and ``up(x)``).

    Holds the same ``gate_proj`` / ``up_proj`` / ``down_proj`` submodules as the transformers
    ``LlamaMLP`` it replaces, so state-dict keys are unchanged. Input ``[..., hidden]`` →
    output ``[..., hidden]``.

    ``maps``: the SwiGLU elementwise maps its down projection runs (default the eager ones;
    :func:`poetxq.model.fuse.fuse_elementwise` sets the compiled ones on one model's MLPs).
    """

    def __init__(
        self,
        gate_proj: POETXLinear,
        up_proj: POETXLinear,
        down_proj: POETXLinear,
        maps: SwiGLUMaps = PLAIN,
    ) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.maps = maps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_swiglu(self.gate_proj(x), self.up_proj(x), self.maps)
