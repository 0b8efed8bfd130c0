"""Fused Cayley–Neumann blocks (Triton) over a dense ``Q``: the math of
:mod:`quant_kernels.cnp_triton`, another memory layout.

:mod:`quant_kernels.cnp_triton` reads every ``Q`` tile straight from the packed upper triangle.
Those addresses are a triangular row offset plus a column: no row starts on an aligned address,
so Triton cannot vectorize the loads, tiles below the diagonal are transposed on the way in, and
the K loops are split at the diagonal into pieces of one or two tiles that cannot be pipelined.
Here ``Q = U − Uᵀ`` is first written out dense (``[nb, b, b]``, the exact
:func:`quant_kernels.skew.skew_forward`), and every product is a plain tiled GEMM over aligned
rows: a K loop of ``BK``-wide steps that Triton software-pipelines (``num_stages``). The cost is
one more ``nb·b²`` intermediate (written once, read by the products) in forward and backward.

The algebra is that of :mod:`quant_kernels.cnp_triton` (its docstring derives it), with
``S = Q²``::

    forward:   S = Q·Q                       upper tile pairs, mirrored (S is symmetric)
               G = I + 2Q + S·B,  B = 2I + 2Q + S    (B formed per K step in registers)
    backward:  S again;  E = M·Bᵀ + S·M,  H = 2M + 2·S·M   (Bᵀ = 2I − 2Q + S; M = ∂L/∂G)
               A = H − Hᵀ − (D·Q + Q·D),  D = E + Eᵀ;  d_packed = strict upper triangle of A

Rounding follows :mod:`quant_kernels.cnp_triton`: products accumulate in fp32; ``S``, ``B``,
``E`` and ``D`` are rounded to the input dtype before they enter a product, ``H`` stays fp32.
The oracle is :func:`quant_kernels.reference.cayley_neumann` (float64 in the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_kernels.cnp_triton import (
    _block_and_pair,
    _block_and_tile,
    _check,
    _pairs,
)
from quant_kernels.dequant_matmul import _dot, _interpreting
from quant_kernels.skew import skew_backward, skew_forward

__all__ = [
    "DenseConfig", "cnp_backward_dense", "cnp_backward_hybrid", "cnp_forward_dense",
    "cnp_forward_hybrid", "default_dense_config",
]  # fmt: skip

_UPCAST = _interpreting()


@triton.jit
def _tile(base, r0, c0, b, BR: tl.constexpr, BC: tl.constexpr):
    """Rows ``r0…r0+BR`` × columns ``c0…c0+BC`` of a dense row-major ``b×b`` matrix at ``base``
    (zero outside it), in its stored dtype."""
    r = r0 + tl.arange(0, BR)[:, None]
    c = c0 + tl.arange(0, BC)[None, :]
    return tl.load(base + r * b + c, mask=(r < b) & (c < b), other=0.0)


@triton.jit
def _plus_eye(x, r0, c0, alpha, BR: tl.constexpr, BC: tl.constexpr):
    """``x + alpha·I`` for the tile at rows ``r0…``, columns ``c0…``."""
    r = r0 + tl.arange(0, BR)[:, None]
    c = c0 + tl.arange(0, BC)[None, :]
    return tl.where(r == c, x + alpha, x)


@triton.jit
def _store_tile(base, val, r0, c0, b, BR: tl.constexpr, BC: tl.constexpr):
    r = r0 + tl.arange(0, BR)[:, None]
    c = c0 + tl.arange(0, BC)[None, :]
    tl.store(base + r * b + c, val.to(base.dtype.element_ty), mask=(r < b) & (c < b))


@triton.jit
def _dense_q2_kernel(
    q_ptr, s_ptr, aux_ptr, pairs_ptr, b, n_pairs, alpha_i, beta_q,
    WRITE_AUX: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """``S = Q·Q`` on tile pair ``(I ≤ J)`` (tile ``(J, I)`` is the transpose) and, with
    ``WRITE_AUX``, ``AUX = alpha_i·I + beta_q·Q + S`` on both tiles (``S`` as stored, rounded)."""
    blk, ti, tj = _block_and_pair(pairs_ptr, n_pairs)
    qb = q_ptr + blk * b * b
    r0, c0 = ti * BM, tj * BM
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, b, BK):
        a = _tile(qb, r0, k0, b, BM, BK)
        c = _tile(qb, k0, c0, b, BK, BM)
        acc = _dot(a, c, acc, UPCAST, IEEE)
    sb = s_ptr + blk * b * b
    val = acc.to(s_ptr.dtype.element_ty)
    _store_tile(sb, val, r0, c0, b, BM, BM)
    if ti != tj:
        _store_tile(sb, tl.trans(val), c0, r0, b, BM, BM)
    if WRITE_AUX:
        ab = aux_ptr + blk * b * b
        sv = val.to(tl.float32)
        bq = beta_q * _tile(qb, r0, c0, b, BM, BM).to(tl.float32)
        _store_tile(ab, _plus_eye(sv + bq, r0, c0, alpha_i, BM, BM), r0, c0, b, BM, BM)
        if ti != tj:  # Q[J, I] = −Q[I, J]ᵀ; no diagonal there
            _store_tile(ab, tl.trans(sv - bq), c0, r0, b, BM, BM)


@triton.jit
def _skew_pairs_kernel(
    packed_ptr, q_ptr, g_ptr, pairs_ptr, b, npk, n_pairs,
    WRITE_G: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """Tiles ``(I, J)`` and ``(J, I)`` of ``Q = U − Uᵀ`` from one coalesced load of ``U[I, J]``
    (tile pair ``I ≤ J``), and with ``WRITE_G`` the same tiles of ``G₀ = I + 2Q``. Exact."""
    blk, ti, tj = _block_and_pair(pairs_ptr, n_pairs)
    r = ti * BM + tl.arange(0, BM)[:, None]
    c = tj * BM + tl.arange(0, BM)[None, :]
    row_off = r * b - ((r * (r + 1)) >> 1) - r - 1
    u = tl.load(packed_ptr + blk * npk + row_off + c, mask=(r < c) & (c < b), other=0.0)
    u = u.to(tl.float32)
    q = u - tl.trans(u) if ti == tj else u
    qb = q_ptr + blk * b * b
    r0, c0 = ti * BM, tj * BM
    _store_tile(qb, q, r0, c0, b, BM, BM)
    if ti != tj:
        _store_tile(qb, -tl.trans(u), c0, r0, b, BM, BM)
    if WRITE_G:
        gb = g_ptr + blk * b * b
        _store_tile(gb, _plus_eye(2.0 * q, r0, c0, 1.0, BM, BM), r0, c0, b, BM, BM)
        if ti != tj:
            _store_tile(gb, -2.0 * tl.trans(u), c0, r0, b, BM, BM)


@triton.jit
def _dense_g_kernel(
    q_ptr, s_ptr, g_ptr, b, n_tiles,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """``G[I, J] = I + 2Q[I, J] + Σ_k S[I, k]·B[k, J]``, ``B = 2I + 2Q + S``."""
    blk, ti, tj = _block_and_tile(n_tiles)
    qb = q_ptr + blk * b * b
    sb = s_ptr + blk * b * b
    r0, c0 = ti * BM, tj * BM
    dt = q_ptr.dtype.element_ty
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, b, BK):
        a = _tile(sb, r0, k0, b, BM, BK)
        bkj = 2.0 * _tile(qb, k0, c0, b, BK, BM).to(tl.float32)
        bkj += _tile(sb, k0, c0, b, BK, BM).to(tl.float32)
        bkj = _plus_eye(bkj, k0, c0, 2.0, BK, BM)
        acc = _dot(a, bkj.to(dt), acc, UPCAST, IEEE)
    acc += 2.0 * _tile(qb, r0, c0, b, BM, BM).to(tl.float32)
    acc = _plus_eye(acc, r0, c0, 1.0, BM, BM)
    _store_tile(g_ptr + blk * b * b, acc, r0, c0, b, BM, BM)


@triton.jit
def _dense_e_kernel(
    q_ptr, s_ptr, m_ptr, e_ptr, h_ptr, b, n_tiles,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """``E = M·Bᵀ + S·M`` (input dtype) and ``H = 2M + 2·S·M`` (fp32) on tile ``(I, J)``."""
    blk, ti, tj = _block_and_tile(n_tiles)
    qb = q_ptr + blk * b * b
    sb = s_ptr + blk * b * b
    mb = m_ptr + blk * b * b
    r0, c0 = ti * BM, tj * BM
    dt = q_ptr.dtype.element_ty
    acc_p = tl.zeros((BM, BM), dtype=tl.float32)
    acc_n = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, b, BK):
        bt = _tile(sb, k0, c0, b, BK, BM).to(tl.float32)
        bt -= 2.0 * _tile(qb, k0, c0, b, BK, BM).to(tl.float32)
        bt = _plus_eye(bt, k0, c0, 2.0, BK, BM)
        acc_p = _dot(_tile(mb, r0, k0, b, BM, BK), bt.to(dt), acc_p, UPCAST, IEEE)
        acc_n = _dot(_tile(sb, r0, k0, b, BM, BK), _tile(mb, k0, c0, b, BK, BM), acc_n,
                     UPCAST, IEEE)  # fmt: skip
    _store_tile(e_ptr + blk * b * b, acc_p + acc_n, r0, c0, b, BM, BM)
    h = 2.0 * (_tile(mb, r0, c0, b, BM, BM).to(tl.float32) + acc_n)
    _store_tile(h_ptr + blk * b * b, h, r0, c0, b, BM, BM)


@triton.jit
def _d_rows(eb, r0, k0, b, BR: tl.constexpr, BC: tl.constexpr):
    """``D[r0…, k0…] = E[r0…, k0…] + E[k0…, r0…]ᵀ`` in fp32."""
    e = _tile(eb, r0, k0, b, BR, BC).to(tl.float32)
    return e + tl.trans(_tile(eb, k0, r0, b, BC, BR).to(tl.float32))


@triton.jit
def _dense_a_kernel(
    q_ptr, e_ptr, h_ptr, dp_ptr, pairs_ptr, b, npk, n_pairs,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """``A = H − Hᵀ − (DQ + QD)`` on tile pair ``(I ≤ J)``; its strict upper part → d_packed."""
    blk, ti, tj = _block_and_pair(pairs_ptr, n_pairs)
    qb = q_ptr + blk * b * b
    eb = e_ptr + blk * b * b
    r0, c0 = ti * BM, tj * BM
    dt = q_ptr.dtype.element_ty
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, b, BK):  # (DQ)[I, J]
        acc = _dot(_d_rows(eb, r0, k0, b, BM, BK).to(dt), _tile(qb, k0, c0, b, BK, BM), acc,
                   UPCAST, IEEE)  # fmt: skip
    if ti == tj:  # (DQ + QD)[I, I] = F − Fᵀ with F = (DQ)[I, I], since (DQ)ᵀ = −QD
        acc = acc - tl.trans(acc)
    else:  # + (QD)[I, J]; D is symmetric, so D[k…, J…] = D[J…, k…]ᵀ
        for k0 in range(0, b, BK):
            d_kj = tl.trans(_d_rows(eb, c0, k0, b, BM, BK))
            acc = _dot(_tile(qb, r0, k0, b, BM, BK), d_kj.to(dt), acc, UPCAST, IEEE)
    hb = h_ptr + blk * b * b
    a = _tile(hb, r0, c0, b, BM, BM) - tl.trans(_tile(hb, c0, r0, b, BM, BM)) - acc
    r = r0 + tl.arange(0, BM)[:, None]
    c = c0 + tl.arange(0, BM)[None, :]
    idx = r * b - ((r * (r + 1)) >> 1) + (c - r - 1)
    tl.store(dp_ptr + blk * npk + idx, a.to(dp_ptr.dtype.element_ty), mask=(r < c) & (c < b))


# ----------------------------------------------------------------------------------------------
# host launchers
# ----------------------------------------------------------------------------------------------

#: ``(BM, BK, num_warps, num_stages)``: square ``BM×BM`` output tiles, ``BK``-wide K steps
DenseConfig = tuple[int, int, int, int]


def default_dense_config(block_size: int, dtype: torch.dtype) -> DenseConfig:
    """``(BM, BK, num_warps, num_stages)`` for ``b = block_size`` and ``dtype``.

    16-bit: 128×128 tiles, 64-wide K steps, 8 warps, 3 stages for ``b ≥ 128``; fp32 (full-
    precision FMA products): 32×32 tiles, 32-wide steps. Smaller ``b`` use one tile of
    ``next_power_of_2(b)``. Under ``TRITON_INTERPRET=1``: 16×16 tiles and 16-wide steps, so the
    CPU tests' small ``b`` run several K steps and partial tiles. ``evals/bench_cnp.py --sweep``
    times alternatives.
    """
    if _UPCAST:
        return 16, 16, 4, 1
    if dtype != torch.float32 and block_size >= 128:
        return 128, 64, 8, 3
    cap = 32 if dtype == torch.float32 else 64
    bm = min(cap, max(16, triton.next_power_of_2(block_size)))
    return bm, min(bm, 64 if dtype != torch.float32 else 32), 4, 2


def _meta(packed: torch.Tensor, b: int, config: DenseConfig | None) -> tuple[int, dict]:
    bm, bk, warps, stages = config or default_dense_config(b, packed.dtype)
    if bm not in (16, 32, 64, 128) or bk not in (16, 32, 64, 128) or warps not in (1, 2, 4, 8):
        raise ValueError(
            f"dense CNP config (BM, BK, warps, stages) = {(bm, bk, warps, stages)}: BM and BK "
            "16/32/64/128, warps 1/2/4/8"
        )
    meta = {
        "UPCAST": _UPCAST, "IEEE": packed.dtype == torch.float32, "BM": bm, "BK": bk,
        "num_warps": warps, "num_stages": stages,
    }  # fmt: skip
    return triton.cdiv(b, bm), meta


def _q_and_s(packed: torch.Tensor, b: int, n_tiles: int, meta: dict):
    q = skew_forward(packed, b)
    s = torch.empty_like(q)
    pairs = _pairs(n_tiles, packed.device)
    n_pairs = pairs.shape[1]
    _dense_q2_kernel[(q.shape[0] * n_pairs,)](
        q, s, s, pairs, b, n_pairs, 0.0, 0.0, WRITE_AUX=False, **meta
    )
    return q, s


def cnp_forward_dense(
    packed: torch.Tensor, block_size: int, *, config: DenseConfig | None = None
) -> torch.Tensor:
    """``G = I + 2Q + 2Q² + 2Q³ + Q⁴`` per block (CNP, ``k = 3``) through a dense ``Q``.

    Same contract as :func:`quant_kernels.cnp_triton.cnp_forward`; transient memory ``Q`` and
    ``Q²`` (``nb·b²`` in ``packed.dtype`` each).

    Args:
        packed: ``[nb, b(b-1)/2]`` fp32/bf16/fp16 on CUDA (strict upper triangles of ``Q``).
        block_size: ``b ≥ 2``.
        config: ``(BM, BK, num_warps, num_stages)``; default :func:`default_dense_config`.

    Returns:
        ``G`` ``[nb, b, b]`` in ``packed.dtype``.

    Raises:
        ValueError: as :func:`quant_kernels.cnp_triton.cnp_forward`, or a bad ``config``.
    """
    _check(packed, block_size)
    b, nb = block_size, packed.shape[0]
    packed = packed.contiguous()
    n_tiles, meta = _meta(packed, b, config)
    g = torch.empty(nb, b, b, dtype=packed.dtype, device=packed.device)
    if nb == 0:
        return g
    q, s = _q_and_s(packed, b, n_tiles, meta)
    _dense_g_kernel[(nb * n_tiles * n_tiles,)](q, s, g, b, n_tiles, **meta)
    return g


def cnp_backward_dense(
    packed: torch.Tensor,
    d_g: torch.Tensor,
    block_size: int,
    *,
    config: DenseConfig | None = None,
) -> torch.Tensor:
    """Gradient of ``⟨d_g, CNP(packed)⟩`` w.r.t. ``packed`` through a dense ``Q``.

    Same contract as :func:`quant_kernels.cnp_triton.cnp_backward`; transient memory ``Q``,
    ``Q²``, ``E`` (``nb·b²`` in ``packed.dtype`` each) and ``H`` (``nb·b²`` fp32).

    Raises:
        ValueError: as :func:`quant_kernels.cnp_triton.cnp_backward`, or a bad ``config``.
    """
    _check(packed, block_size)
    b, nb = block_size, packed.shape[0]
    if d_g.shape != (nb, b, b):
        raise ValueError(f"d_g must be [{nb}, {b}, {b}], got {tuple(d_g.shape)}")
    packed = packed.contiguous()
    d_g = d_g.to(packed.dtype).contiguous()
    n_tiles, meta = _meta(packed, b, config)
    d_packed = torch.empty_like(packed)
    if nb == 0:
        return d_packed
    q, s = _q_and_s(packed, b, n_tiles, meta)
    e = torch.empty_like(q)
    h = torch.empty(nb, b, b, dtype=torch.float32, device=packed.device)
    _dense_e_kernel[(nb * n_tiles * n_tiles,)](q, s, d_g, e, h, b, n_tiles, **meta)
    del s
    pairs = _pairs(n_tiles, packed.device)
    n_pairs = pairs.shape[1]
    _dense_a_kernel[(nb * n_pairs,)](q, e, h, d_packed, pairs, b, packed.shape[1], n_pairs, **meta)
    return d_packed


# ----------------------------------------------------------------------------------------------
# hybrid: Triton for Q, Q² and the elementwise terms, cuBLAS for the full b×b products
# ----------------------------------------------------------------------------------------------

#: transient bytes per buffer per chunk of blocks (``Q``, ``S``, ``AUX`` … each ``chunk·b²``)
CHUNK_BYTES = 256 * 2**20
_SKEW_BM = 16 if _UPCAST else 64


def _chunks(nb: int, b: int, elt: int, chunk_bytes: int) -> int:
    return max(1, min(nb, chunk_bytes // (b * b * elt)))


def _skew_pairs(packed: torch.Tensor, q: torch.Tensor, g: torch.Tensor | None, b: int) -> None:
    pairs = _pairs(triton.cdiv(b, _SKEW_BM), packed.device)
    n_pairs = pairs.shape[1]
    _skew_pairs_kernel[(packed.shape[0] * n_pairs,)](
        packed, q, q if g is None else g, pairs, b, packed.shape[1], n_pairs,
        WRITE_G=g is not None, BM=_SKEW_BM,
    )  # fmt: skip


def _q2_aux(q, s, aux, b, n_tiles, meta, alpha_i: float, beta_q: float) -> None:
    pairs = _pairs(n_tiles, q.device)
    n_pairs = pairs.shape[1]
    _dense_q2_kernel[(q.shape[0] * n_pairs,)](
        q, s, aux, pairs, b, n_pairs, alpha_i, beta_q, WRITE_AUX=True, **meta
    )


def cnp_forward_hybrid(
    packed: torch.Tensor,
    block_size: int,
    *,
    config: DenseConfig | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """``G = I + 2Q + S·B`` (``S = Q²``, ``B = 2I + 2Q + S``; CNP with ``k = 3``), chunk by
    chunk of blocks: one Triton pass writes ``Q`` and ``G₀ = I + 2Q``, one writes ``S`` (upper
    tile pairs) and ``B``, and cuBLAS adds ``S·B`` into ``G`` (``baddbmm_``).

    Same contract as :func:`quant_kernels.cnp_triton.cnp_forward`; transient memory three
    buffers of ``chunk_bytes`` (``Q``, ``S``, ``B``) whatever the number of blocks.

    Args:
        packed: ``[nb, b(b-1)/2]`` fp32/bf16/fp16 on CUDA (strict upper triangles of ``Q``).
        block_size: ``b ≥ 2``.
        config: ``(BM, BK, num_warps, num_stages)`` of the ``S`` kernel; default
            :func:`default_dense_config`.
        chunk_bytes: bytes of one ``[chunk, b, b]`` buffer.

    Returns:
        ``G`` ``[nb, b, b]`` in ``packed.dtype``.

    Raises:
        ValueError: as :func:`quant_kernels.cnp_triton.cnp_forward`, or a bad ``config``.
    """
    _check(packed, block_size)
    b, nb = block_size, packed.shape[0]
    packed = packed.contiguous()
    n_tiles, meta = _meta(packed, b, config)
    g = torch.empty(nb, b, b, dtype=packed.dtype, device=packed.device)
    chunk = _chunks(nb, b, packed.element_size(), chunk_bytes)
    q = s = aux = None
    for c0 in range(0, nb, chunk):
        c1 = min(nb, c0 + chunk)
        if q is None or q.shape[0] != c1 - c0:
            q, s, aux = (packed.new_empty(c1 - c0, b, b) for _ in range(3))
        _skew_pairs(packed[c0:c1], q, g[c0:c1], b)
        _q2_aux(q, s, aux, b, n_tiles, meta, 2.0, 2.0)
        g[c0:c1].baddbmm_(s, aux)
    return g


def cnp_backward_hybrid(
    packed: torch.Tensor,
    d_g: torch.Tensor,
    block_size: int,
    *,
    config: DenseConfig | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """Gradient of ``⟨d_g, CNP(packed)⟩`` w.r.t. ``packed``, chunk by chunk of blocks.

    With ``M = d_g``, ``S = Q²`` and :mod:`quant_kernels.cnp_triton`'s ``E``, ``H``, ``D``:
    ``H = 2P`` with ``P = M + S·M``; ``E = P + M·C`` with ``C = I − 2Q + S``; and since ``D``
    is symmetric and ``Q`` skew, ``DQ + QD = DQ − (DQ)ᵀ``, so the packed gradient is the strict
    upper triangle of ``Y − Yᵀ`` with ``Y = 2P − E·Q − Eᵀ·Q``. Triton writes ``Q``, ``S`` and
    ``C``; cuBLAS runs the four products (``baddbmm``, in place where it can);
    :func:`quant_kernels.skew.skew_backward` folds ``Y`` into ``d_packed``.

    Same contract as :func:`quant_kernels.cnp_triton.cnp_backward`; transient memory five
    buffers of ``chunk_bytes``.

    Raises:
        ValueError: as :func:`quant_kernels.cnp_triton.cnp_backward`, or a bad ``config``.
    """
    _check(packed, block_size)
    b, nb = block_size, packed.shape[0]
    if d_g.shape != (nb, b, b):
        raise ValueError(f"d_g must be [{nb}, {b}, {b}], got {tuple(d_g.shape)}")
    packed = packed.contiguous()
    d_g = d_g.to(packed.dtype).contiguous()
    n_tiles, meta = _meta(packed, b, config)
    d_packed = torch.empty_like(packed)
    chunk = _chunks(nb, b, packed.element_size(), chunk_bytes)
    q = s = aux = p = e = None
    for c0 in range(0, nb, chunk):
        c1 = min(nb, c0 + chunk)
        if q is None or q.shape[0] != c1 - c0:
            q, s, aux, p, e = (packed.new_empty(c1 - c0, b, b) for _ in range(5))
        m = d_g[c0:c1]
        _skew_pairs(packed[c0:c1], q, None, b)
        _q2_aux(q, s, aux, b, n_tiles, meta, 1.0, -2.0)
        torch.baddbmm(m, s, m, out=p)  # P = M + S·M
        torch.baddbmm(p, m, aux, out=e)  # E = P + M·C
        p.baddbmm_(e, q, beta=2.0, alpha=-1.0)  # Y = 2P − E·Q
        p.baddbmm_(e.transpose(1, 2), q, alpha=-1.0)  # Y −= Eᵀ·Q
        skew_backward(p, out=d_packed[c0:c1])
    return d_packed
