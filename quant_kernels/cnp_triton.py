"""Fused Cayley–Neumann blocks (Triton), forward and hand-derived backward, for ``k = 3`` terms.

CNP (POET, arXiv 2506.08001): each ``b×b`` orthogonal block is ``G = (I + Q)(I + Q + Q² + Q³)``
with ``Q = U − Uᵀ`` skew-symmetric, ``U`` the strict upper triangle stored row-major
(``torch.triu_indices(b, b, 1)`` order) in ``packed [nb, b(b-1)/2]``. The dense ``Q`` is never
built: every kernel reads its ``Q`` tiles straight from ``packed`` with index math,

    ``Q[i, j] = packed[idx(i, j)]`` (i < j),  ``−packed[idx(j, i)]`` (i > j),  ``0`` (i = j),
    ``idx(i, j) = i·b − i(i+1)/2 + (j − i − 1)``,

and ``Q² = QQ`` is the only ``b×b`` intermediate of the forward (written once, read by the second
kernel). A row of ``U`` is contiguous in ``packed``, so an above-diagonal tile is a row offset
plus a column (coalesced), a below-diagonal tile is the transposed (negated) tile above it, and a
diagonal tile is ``U − Uᵀ`` of one load. Every K loop is split at the diagonal into pieces whose
``Q``-tile position is known at compile time, so no loop iteration branches on it.

Everything is tiled in square tiles, ``T = ⌈b/tile⌉`` per side, one program per (block, tile)
or per (block, tile pair ``I ≤ J``) where the result is symmetric or skew: 64×64 for bf16/fp16
(tensor cores), 32×32 for fp32 (full-precision FMA products as torch's default fp32 matmul, no
tf32; 64×64 spills registers there), 16×16 under ``TRITON_INTERPRET=1``
(:func:`default_config`). Any ``b ≥ 2`` works (partial tiles are masked). Products accumulate in
fp32; intermediates are stored in the input dtype (as the torch reference's are) except ``H``
below (fp32).

Forward (2 kernels, ``(1.5 + 1/2T)·b³`` multiply-adds per block against the reference's
``2·b³``)::

    Q² = Q·Q                    symmetric ((Q²)ᵀ = QᵀQᵀ = Q²): upper tile pairs only, mirrored
    B  = 2I + 2Q + Q²           built tile by tile in registers, never stored
    G  = I + 2Q + Q²·B          = I + 2Q + 2Q² + 2Q³ + Q⁴

Backward, derived by hand. Let ``M = ∂L/∂G``. Reverse mode through the three lines above, using
``Qᵀ = −Q`` and ``(Q²)ᵀ = Q²`` (so ``Bᵀ = 2I − 2Q + Q²``)::

    G = … + Q²·B   →  ∂Q² += M·Bᵀ,   ∂B = (Q²)ᵀM = Q²M
    G = … + 2Q     →  ∂Q  += 2M
    B = 2I+2Q+Q²   →  ∂Q  += 2·Q²M,  ∂Q² += Q²M
    Q² = Q·Q       →  ∂Q  += ∂Q²·Qᵀ + Qᵀ·∂Q² = −(E·Q + Q·E)

    with E := ∂Q² = M·Bᵀ + Q²M,  N := Q²M:   ∂Q = 2M + 2N − EQ − QE.

``Q = U − Uᵀ`` gives ``∂U[i, j] = ∂Q[i, j] − ∂Q[j, i]`` (i < j), i.e. the strict upper triangle
of the skew matrix ``A = ∂Q − ∂Qᵀ``. Transposing, ``(EQ + QE)ᵀ = −(QEᵀ + EᵀQ)`` and
``Nᵀ = MᵀQ²``, so with the symmetric ``D := E + Eᵀ`` and ``H := 2M + 2N``::

    A = (H − Hᵀ) − (D·Q + Q·D),           d_packed[idx(i, j)] = A[i, j]  (i < j).

On a diagonal tile ``(DQ + QD)[I, I] = F − Fᵀ`` with ``F = (DQ)[I, I]`` (because
``(DQ)ᵀ = −QD``), so those tiles need one product instead of two. Backward kernels (recomputing
``Q²`` first, ``(3.5 + 1/2T)·b³`` multiply-adds per block, against ``4·b³`` for autograd of the
reference and ``6·b³`` for the recomputing :func:`quant_kernels.cnp.cayley_neumann_lean`)::

    Q²                  as in forward (upper tile pairs)
    E = M·Bᵀ + Q²M,  H = 2M + 2·Q²M      every tile;  E in the input dtype, H in fp32
    A = H − Hᵀ − (DQ + QD)               upper tile pairs; D = E + Eᵀ formed tile by tile;
                                         only the strict upper triangle is stored, packed

:func:`cayley_neumann_fused` wraps both in an autograd Function that saves only ``packed`` (like
:func:`quant_kernels.cnp.cayley_neumann_lean`). The oracle is
:func:`quant_kernels.reference.cayley_neumann`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_kernels.dequant_matmul import _dot, _interpreting

__all__ = ["cayley_neumann_fused", "cnp_backward", "cnp_forward", "default_config"]

_UPCAST = _interpreting()
#: dtypes of ``packed`` the kernels accept (fp32 accumulation in all of them)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------
# tile loaders
# ----------------------------------------------------------------------------------------------

# Where a ``Q`` tile lies. The K loops are split at the diagonal so that every loop reads its ``Q``
# tiles in one statically known way (no per-iteration branches, which cost registers).
_UP: tl.constexpr = tl.constexpr(0)  # t_row < t_col: a tile of U
_LO: tl.constexpr = tl.constexpr(1)  # t_row > t_col: −(tile of U)ᵀ
_DIAG: tl.constexpr = tl.constexpr(2)  # t_row = t_col: U − Uᵀ


@triton.jit
def _load_u(base, t_lo, t_hi, b, BLOCK: tl.constexpr):
    """Tile ``(t_lo, t_hi)``, ``t_lo ≤ t_hi``, of the strict upper triangle ``U`` of one block, in
    fp32 (exact; the interpreter cannot negate 16-bit floats), zero elsewhere. A row of ``U`` is
    contiguous in ``packed``: ``U[r, c] = packed[r·b − r(r+1)/2 − r − 1 + c]`` (``c > r``), so the
    address is a row offset plus the column and neighbouring lanes read neighbouring entries."""
    r = t_lo * BLOCK + tl.arange(0, BLOCK)
    c = t_hi * BLOCK + tl.arange(0, BLOCK)
    row_off = r * b - ((r * (r + 1)) >> 1) - r - 1
    mask = (r[:, None] < c[None, :]) & (c[None, :] < b)
    return tl.load(base + row_off[:, None] + c[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _q_tile(base, t_row, t_col, b, WHERE: tl.constexpr, BLOCK: tl.constexpr):
    """Tile ``(t_row, t_col)`` of ``Q = U − Uᵀ`` in fp32, its position ``WHERE`` known statically:
    ``U[I, K]`` above the diagonal, ``−U[K, I]ᵀ`` below it, ``U[I, I] − U[I, I]ᵀ`` on it."""
    if WHERE == _UP:
        q = _load_u(base, t_row, t_col, b, BLOCK)
    elif WHERE == _LO:
        q = -tl.trans(_load_u(base, t_col, t_row, b, BLOCK))
    else:
        u = _load_u(base, t_row, t_row, b, BLOCK)
        q = u - tl.trans(u)
    return q


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
def _load_tile(base, t_row, t_col, b, BLOCK: tl.constexpr):
    """Tile ``(t_row, t_col)`` of a dense row-major ``b×b`` matrix at ``base`` (zero-padded)."""
    return _tile(base, t_row * BLOCK, t_col * BLOCK, b, BLOCK, BLOCK)


@triton.jit
def _eye_plus(x, t_row, t_col, alpha, BLOCK: tl.constexpr):
    """``x + alpha·I`` on tile ``(t_row, t_col)``."""
    return _plus_eye(x, t_row * BLOCK, t_col * BLOCK, alpha, BLOCK, BLOCK)


@triton.jit
def _d_tile(eb, t_row, t_col, b, BLOCK: tl.constexpr):
    """Tile ``(t_row, t_col)`` of ``D = E + Eᵀ`` in fp32."""
    e = _load_tile(eb, t_row, t_col, b, BLOCK).to(tl.float32)
    return e + tl.trans(_load_tile(eb, t_col, t_row, b, BLOCK).to(tl.float32))


@triton.jit
def _block_and_pair(pairs_ptr, n_pairs):
    """(block, I, J) of this program: programs run over blocks × tile pairs ``I ≤ J``."""
    pid = tl.program_id(0)
    p = pid % n_pairs
    return (pid // n_pairs).to(tl.int64), tl.load(pairs_ptr + p), tl.load(pairs_ptr + n_pairs + p)


@triton.jit
def _block_and_tile(n_tiles):
    """(block, I, J) of this program: programs run over blocks × all ``T²`` tiles."""
    pid = tl.program_id(0)
    per = n_tiles * n_tiles
    t = pid % per
    return (pid // per).to(tl.int64), t // n_tiles, t % n_tiles


# ----------------------------------------------------------------------------------------------
# K-loop pieces (one static Q-tile position each)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _acc_qq(acc, qb, ti, tj, k0, k1, b, A: tl.constexpr, B: tl.constexpr,
            UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``acc += Σ_{K∈[k0,k1)} Q[I, K]·Q[K, J]`` (``Q[I, K]`` at ``A``, ``Q[K, J]`` at ``B``)."""
    dt = qb.dtype.element_ty
    for tk in range(k0, k1):
        a = _q_tile(qb, ti, tk, b, A, BLOCK).to(dt)
        c = _q_tile(qb, tk, tj, b, B, BLOCK).to(dt)
        acc = _dot(a, c, acc, UPCAST, IEEE)
    return acc


@triton.jit
def _acc_g(acc, qb, q2b, ti, tj, k0, k1, b, WHERE: tl.constexpr,
           UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``acc += Σ_{K∈[k0,k1)} Q²[I, K]·B[K, J]``, ``B = 2I + 2Q + Q²``, ``Q[K, J]`` at
    ``WHERE``."""
    for tk in range(k0, k1):
        a = _load_tile(q2b, ti, tk, b, BLOCK)
        bkj = 2.0 * _q_tile(qb, tk, tj, b, WHERE, BLOCK)
        bkj += _load_tile(q2b, tk, tj, b, BLOCK).to(tl.float32)
        if WHERE == _DIAG:
            bkj = _eye_plus(bkj, tk, tj, 2.0, BLOCK)
        acc = _dot(a, bkj.to(a.dtype), acc, UPCAST, IEEE)
    return acc


@triton.jit
def _acc_e(acc_p, acc_n, qb, q2b, mb, ti, tj, k0, k1, b, WHERE: tl.constexpr,
           UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``acc_p += Σ M[I, K]·Bᵀ[K, J]`` (``Bᵀ = 2I − 2Q + Q²``), ``acc_n += Σ Q²[I, K]·M[K, J]``
    over ``K ∈ [k0, k1)``, ``Q[K, J]`` at ``WHERE``."""
    for tk in range(k0, k1):
        m_ik = _load_tile(mb, ti, tk, b, BLOCK)
        bt = _load_tile(q2b, tk, tj, b, BLOCK).to(tl.float32)
        bt -= 2.0 * _q_tile(qb, tk, tj, b, WHERE, BLOCK)
        if WHERE == _DIAG:
            bt = _eye_plus(bt, tk, tj, 2.0, BLOCK)
        acc_p = _dot(m_ik, bt.to(m_ik.dtype), acc_p, UPCAST, IEEE)
        acc_n = _dot(_load_tile(q2b, ti, tk, b, BLOCK), _load_tile(mb, tk, tj, b, BLOCK), acc_n,
                     UPCAST, IEEE)  # fmt: skip
    return acc_p, acc_n


@triton.jit
def _acc_dq(acc, qb, eb, ti, tj, k0, k1, b, WHERE: tl.constexpr,
            UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``acc += Σ_{K∈[k0,k1)} D[I, K]·Q[K, J]`` (``Q[K, J]`` at ``WHERE``)."""
    dt = qb.dtype.element_ty
    for tk in range(k0, k1):
        q = _q_tile(qb, tk, tj, b, WHERE, BLOCK).to(dt)
        acc = _dot(_d_tile(eb, ti, tk, b, BLOCK).to(dt), q, acc, UPCAST, IEEE)
    return acc


@triton.jit
def _acc_qd(acc, qb, eb, ti, tj, k0, k1, b, WHERE: tl.constexpr,
            UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``acc += Σ_{K∈[k0,k1)} Q[I, K]·D[K, J]`` (``Q[I, K]`` at ``WHERE``)."""
    dt = qb.dtype.element_ty
    for tk in range(k0, k1):
        q = _q_tile(qb, ti, tk, b, WHERE, BLOCK).to(dt)
        acc = _dot(q, _d_tile(eb, tk, tj, b, BLOCK).to(dt), acc, UPCAST, IEEE)
    return acc


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _cnp_q2_kernel(
    packed_ptr, q2_ptr, pairs_ptr, b, npk, n_pairs, n_tiles,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``Q² = Q·Q`` for tile pair ``(I ≤ J)``: tile ``(I, J)`` and, mirrored, ``(J, I)``."""
    blk, ti, tj = _block_and_pair(pairs_ptr, n_pairs)
    qb = packed_ptr + blk * npk
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    # K < I ≤ J: Q[I, K] below, Q[K, J] above the diagonal; then I < K < J; then K > J
    acc = _acc_qq(acc, qb, ti, tj, 0, ti, b, _LO, _UP, UPCAST, IEEE, BLOCK)
    acc = _acc_qq(acc, qb, ti, tj, ti + 1, tj, b, _UP, _UP, UPCAST, IEEE, BLOCK)
    acc = _acc_qq(acc, qb, ti, tj, tj + 1, n_tiles, b, _UP, _LO, UPCAST, IEEE, BLOCK)
    if ti == tj:  # K = I = J
        acc = _acc_qq(acc, qb, ti, tj, ti, ti + 1, b, _DIAG, _DIAG, UPCAST, IEEE, BLOCK)
    else:  # K = I, then K = J
        acc = _acc_qq(acc, qb, ti, tj, ti, ti + 1, b, _DIAG, _UP, UPCAST, IEEE, BLOCK)
        acc = _acc_qq(acc, qb, ti, tj, tj, tj + 1, b, _UP, _DIAG, UPCAST, IEEE, BLOCK)
    out = q2_ptr + blk * b * b
    offs = tl.arange(0, BLOCK)
    val = acc.to(q2_ptr.dtype.element_ty)
    r = ti * BLOCK + offs[:, None]
    c = tj * BLOCK + offs[None, :]
    tl.store(out + r * b + c, val, mask=(r < b) & (c < b))
    if ti != tj:
        rt = tj * BLOCK + offs[:, None]
        ct = ti * BLOCK + offs[None, :]
        tl.store(out + rt * b + ct, tl.trans(val), mask=(rt < b) & (ct < b))


@triton.jit
def _cnp_g_kernel(
    packed_ptr, q2_ptr, g_ptr, b, npk, n_tiles,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``G[I, J] = I + 2Q[I, J] + Σ_K Q²[I, K]·B[K, J]`` with ``B = 2I + 2Q + Q²``."""
    blk, ti, tj = _block_and_tile(n_tiles)
    qb = packed_ptr + blk * npk
    q2b = q2_ptr + blk * b * b
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    acc = _acc_g(acc, qb, q2b, ti, tj, 0, tj, b, _UP, UPCAST, IEEE, BLOCK)
    acc = _acc_g(acc, qb, q2b, ti, tj, tj, tj + 1, b, _DIAG, UPCAST, IEEE, BLOCK)
    acc = _acc_g(acc, qb, q2b, ti, tj, tj + 1, n_tiles, b, _LO, UPCAST, IEEE, BLOCK)
    if ti < tj:
        acc += 2.0 * _q_tile(qb, ti, tj, b, _UP, BLOCK)
    elif ti > tj:
        acc += 2.0 * _q_tile(qb, ti, tj, b, _LO, BLOCK)
    else:
        acc = _eye_plus(acc + 2.0 * _q_tile(qb, ti, tj, b, _DIAG, BLOCK), ti, tj, 1.0, BLOCK)
    r = ti * BLOCK + tl.arange(0, BLOCK)[:, None]
    c = tj * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (r < b) & (c < b)
    tl.store(g_ptr + blk * b * b + r * b + c, acc.to(g_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cnp_bwd_e_kernel(
    packed_ptr, q2_ptr, dg_ptr, e_ptr, h_ptr, b, npk, n_tiles,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``E = M·Bᵀ + Q²M`` and ``H = 2M + 2Q²M`` on tile ``(I, J)`` (``Bᵀ = 2I − 2Q + Q²``)."""
    blk, ti, tj = _block_and_tile(n_tiles)
    qb = packed_ptr + blk * npk
    q2b = q2_ptr + blk * b * b
    mb = dg_ptr + blk * b * b
    acc_p = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    acc_n = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    acc_p, acc_n = _acc_e(acc_p, acc_n, qb, q2b, mb, ti, tj, 0, tj, b, _UP, UPCAST, IEEE, BLOCK)
    acc_p, acc_n = _acc_e(acc_p, acc_n, qb, q2b, mb, ti, tj, tj, tj + 1, b, _DIAG, UPCAST, IEEE,
                          BLOCK)  # fmt: skip
    acc_p, acc_n = _acc_e(acc_p, acc_n, qb, q2b, mb, ti, tj, tj + 1, n_tiles, b, _LO, UPCAST,
                          IEEE, BLOCK)  # fmt: skip
    r = ti * BLOCK + tl.arange(0, BLOCK)[:, None]
    c = tj * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (r < b) & (c < b)
    tl.store(e_ptr + blk * b * b + r * b + c, (acc_p + acc_n).to(e_ptr.dtype.element_ty), mask=mask)
    h = 2.0 * (_load_tile(mb, ti, tj, b, BLOCK).to(tl.float32) + acc_n)
    tl.store(h_ptr + blk * b * b + r * b + c, h, mask=mask)


@triton.jit
def _cnp_bwd_a_kernel(
    packed_ptr, e_ptr, h_ptr, dp_ptr, pairs_ptr, b, npk, n_pairs, n_tiles,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``A = H − Hᵀ − (DQ + QD)`` on tile pair ``(I ≤ J)``; its strict upper part → d_packed."""
    blk, ti, tj = _block_and_pair(pairs_ptr, n_pairs)
    qb = packed_ptr + blk * npk
    eb = e_ptr + blk * b * b
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    # (DQ)[I, J]: Q[K, J] above the diagonal for K < J, on it for K = J, below it for K > J
    acc = _acc_dq(acc, qb, eb, ti, tj, 0, tj, b, _UP, UPCAST, IEEE, BLOCK)
    acc = _acc_dq(acc, qb, eb, ti, tj, tj, tj + 1, b, _DIAG, UPCAST, IEEE, BLOCK)
    acc = _acc_dq(acc, qb, eb, ti, tj, tj + 1, n_tiles, b, _LO, UPCAST, IEEE, BLOCK)
    if ti == tj:  # (DQ + QD)[I, I] = F − Fᵀ with F = (DQ)[I, I]
        acc = acc - tl.trans(acc)
    else:  # + (QD)[I, J]: Q[I, K] below the diagonal for K < I, on it for K = I, above for K > I
        acc = _acc_qd(acc, qb, eb, ti, tj, 0, ti, b, _LO, UPCAST, IEEE, BLOCK)
        acc = _acc_qd(acc, qb, eb, ti, tj, ti, ti + 1, b, _DIAG, UPCAST, IEEE, BLOCK)
        acc = _acc_qd(acc, qb, eb, ti, tj, ti + 1, n_tiles, b, _UP, UPCAST, IEEE, BLOCK)
    hb = h_ptr + blk * b * b
    a = _load_tile(hb, ti, tj, b, BLOCK) - tl.trans(_load_tile(hb, tj, ti, b, BLOCK)) - acc
    r = ti * BLOCK + tl.arange(0, BLOCK)[:, None]
    c = tj * BLOCK + tl.arange(0, BLOCK)[None, :]
    idx = r * b - ((r * (r + 1)) >> 1) + (c - r - 1)
    tl.store(dp_ptr + blk * npk + idx, a.to(dp_ptr.dtype.element_ty), mask=(r < c) & (c < b))


# ----------------------------------------------------------------------------------------------
# host launchers
# ----------------------------------------------------------------------------------------------


def default_config(block_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(tile, num_warps)`` the launchers use for ``b = block_size`` and ``dtype``.

    bf16 / fp16: 128×128 tiles with 8 warps for ``b ≥ 128`` (Llama-8B blocks at b = 256,
    forward+backward: 20.4 ms against 23.0 ms with 64×64 / 4 warps and 28.0 with 64×64 / 8,
    ``evals/results/cnp_sweep_bf16_h200.json``), else one tile of ``next_power_of_2(b)`` (at
    least 16). fp32 (full-precision FMA products, no tensor cores) spills at 64×64 and fits at
    32×32 (compile statistics for sm_90). The interpreter uses 16×16 so that the CPU tests' small
    ``b`` exercise partial tiles. ``evals/bench_cnp.py --sweep`` times the alternatives.
    """
    if _UPCAST:
        return 16, 4
    if dtype != torch.float32 and block_size >= 128:
        return 128, 8
    cap = 32 if dtype == torch.float32 else 64
    return min(cap, max(16, triton.next_power_of_2(block_size))), 4


_PAIRS: dict[tuple[int, str], torch.Tensor] = {}


def _pairs(n_tiles: int, device: torch.device) -> torch.Tensor:
    """``[2, T(T+1)/2]`` int32: the tile pairs ``(I ≤ J)`` (cached per device)."""
    key = (n_tiles, str(device))
    pairs = _PAIRS.get(key)
    if pairs is None:
        pairs = torch.triu_indices(n_tiles, n_tiles, device=device).to(torch.int32)
        # a tensor made during CUDA-graph capture holds its values only in the graph's replays
        if not (pairs.is_cuda and torch.cuda.is_current_stream_capturing()):
            _PAIRS[key] = pairs
    return pairs


def _check(packed: torch.Tensor, block_size: int) -> None:
    if block_size < 2:
        raise ValueError(f"block size b={block_size} must be >= 2")
    if packed.dim() != 2 or packed.shape[1] != block_size * (block_size - 1) // 2:
        raise ValueError(
            f"packed must be [nb, b(b-1)/2] = [nb, {block_size * (block_size - 1) // 2}] for "
            f"b={block_size}, got {tuple(packed.shape)}"
        )
    if packed.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"packed dtype {packed.dtype} unsupported; use fp32, bf16 or fp16")
    if not (packed.is_cuda or _UPCAST):
        raise ValueError("the fused CNP needs a CUDA tensor (or TRITON_INTERPRET=1 on the CPU)")


def _backward_inputs(
    packed: torch.Tensor, d_g: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``packed`` and ``d_g`` checked (:func:`_check`, ``d_g`` ``[nb, b, b]``) and made
    contiguous, ``d_g`` in ``packed.dtype``; shared by both layouts' backward.

    Raises:
        ValueError: as :func:`_check`, or ``d_g`` of the wrong shape.
    """
    _check(packed, block_size)
    nb, b = packed.shape[0], block_size
    if d_g.shape != (nb, b, b):
        raise ValueError(f"d_g must be [{nb}, {b}, {b}], got {tuple(d_g.shape)}")
    return packed.contiguous(), d_g.to(packed.dtype).contiguous()


def _launch_params(
    packed: torch.Tensor, b: int, config: tuple[int, int] | None
) -> tuple[int, int, dict]:
    if config is not None and len(config) != 2:
        raise ValueError(
            f"config {tuple(config)}: the packed layout takes (tile, num_warps); "
            "(BM, BK, num_warps, num_stages) is the hybrid layout's"
        )
    tile, warps = config or default_config(b, packed.dtype)
    if tile not in (16, 32, 64, 128) or warps not in (1, 2, 4, 8, 16):
        raise ValueError(
            f"config (tile, num_warps) = {(tile, warps)}: tile 16/32/64/128, warps 1/2/4/8/16"
        )
    meta = {
        "UPCAST": _UPCAST, "IEEE": packed.dtype == torch.float32, "BLOCK": tile,
        "num_warps": warps, "num_stages": 1,  # K loops are 1-8 tiles long: nothing to pipeline
    }  # fmt: skip
    return tile, triton.cdiv(b, tile), meta


def _q2(packed: torch.Tensor, b: int, n_tiles: int, meta: dict) -> torch.Tensor:
    nb = packed.shape[0]
    q2 = torch.empty(nb, b, b, dtype=packed.dtype, device=packed.device)
    pairs = _pairs(n_tiles, packed.device)
    n_pairs = pairs.shape[1]
    _cnp_q2_kernel[(nb * n_pairs,)](packed, q2, pairs, b, packed.shape[1], n_pairs, n_tiles, **meta)
    return q2


def cnp_forward(
    packed: torch.Tensor, block_size: int, *, config: tuple[int, int] | None = None
) -> torch.Tensor:
    """``G = I + 2Q + 2Q² + 2Q³ + Q⁴`` per block (CNP with ``k = 3``), no autograd.

    Args:
        packed: ``[nb, b(b-1)/2]`` fp32/bf16/fp16 on CUDA (strict upper triangles of ``Q``,
            ``torch.triu_indices`` order).
        block_size: ``b ≥ 2``.
        config: ``(tile, num_warps)``; default :func:`default_config`.

    Returns:
        ``G`` ``[nb, b, b]`` in ``packed.dtype`` (fp32 accumulation).

    Raises:
        ValueError: wrong width for ``b``, ``b < 2``, unsupported dtype or config, or not a CUDA
            tensor (outside the Triton interpreter).
    """
    _check(packed, block_size)
    b, nb = block_size, packed.shape[0]
    packed = packed.contiguous()
    _, n_tiles, meta = _launch_params(packed, b, config)
    g = torch.empty(nb, b, b, dtype=packed.dtype, device=packed.device)
    if nb == 0:
        return g
    q2 = _q2(packed, b, n_tiles, meta)
    _cnp_g_kernel[(nb * n_tiles * n_tiles,)](packed, q2, g, b, packed.shape[1], n_tiles, **meta)
    return g


def cnp_backward(
    packed: torch.Tensor,
    d_g: torch.Tensor,
    block_size: int,
    *,
    config: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Gradient of ``⟨d_g, CNP(packed)⟩`` with respect to ``packed`` (module docstring).

    Args:
        packed: ``[nb, b(b-1)/2]`` as in :func:`cnp_forward`.
        d_g: ``[nb, b, b]`` gradient of ``G`` (cast to ``packed.dtype``).
        block_size: ``b``.
        config: ``(tile, num_warps)``; default :func:`default_config`.

    Returns:
        ``d_packed`` ``[nb, b(b-1)/2]`` in ``packed.dtype``. Transient memory: ``Q²`` and ``E``
        (``nb·b²`` in ``packed.dtype`` each) and ``H`` (``nb·b²`` fp32).

    Raises:
        ValueError: as :func:`cnp_forward`, or ``d_g`` of the wrong shape.
    """
    packed, d_g = _backward_inputs(packed, d_g, block_size)
    b, nb = block_size, packed.shape[0]
    _, n_tiles, meta = _launch_params(packed, b, config)
    d_packed = torch.empty_like(packed)
    if nb == 0:
        return d_packed
    npk = packed.shape[1]
    q2 = _q2(packed, b, n_tiles, meta)
    e = torch.empty_like(q2)
    h = torch.empty(nb, b, b, dtype=torch.float32, device=packed.device)
    _cnp_bwd_e_kernel[(nb * n_tiles * n_tiles,)](packed, q2, d_g, e, h, b, npk, n_tiles, **meta)
    del q2
    pairs = _pairs(n_tiles, packed.device)
    n_pairs = pairs.shape[1]
    _cnp_bwd_a_kernel[(nb * n_pairs,)](
        packed, e, h, d_packed, pairs, b, npk, n_pairs, n_tiles, **meta
    )
    return d_packed


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------


#: the kernel families :func:`cayley_neumann_fused` can run (``layout``)
LAYOUTS = ("packed", "hybrid")


def _forward(packed: torch.Tensor, block_size: int, config, layout: str) -> torch.Tensor:
    if layout == "hybrid":
        from quant_kernels.cnp_hybrid import cnp_forward_hybrid

        return cnp_forward_hybrid(packed, block_size, config=config)
    return cnp_forward(packed, block_size, config=config)


def _backward(packed: torch.Tensor, d_g: torch.Tensor, block_size: int, config, layout: str):
    if layout == "hybrid":
        from quant_kernels.cnp_hybrid import cnp_backward_hybrid

        return cnp_backward_hybrid(packed, d_g, block_size, config=config)
    return cnp_backward(packed, d_g, block_size, config=config)


class _CayleyNeumannFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, packed: torch.Tensor, block_size: int, config, layout: str) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(packed)
        ctx.block_size, ctx.config, ctx.layout = block_size, config, layout
        return _forward(packed, block_size, config, layout)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_g: torch.Tensor):  # type: ignore[override]
        (packed,) = ctx.saved_tensors
        return _backward(packed, d_g, ctx.block_size, ctx.config, ctx.layout), None, None, None


def cayley_neumann_fused(
    packed: torch.Tensor,
    block_size: int,
    terms: int = 3,
    *,
    config: tuple[int, ...] | None = None,
    layout: str = "hybrid",
) -> torch.Tensor:
    """Fused Triton :func:`~quant_kernels.reference.cayley_neumann` for ``k = 3`` (POET,
    arXiv 2506.08001): ``G = I + 2(Q + Q² + Q³) + Q⁴`` with ``Q = U − Uᵀ``.

    Saves only ``packed`` for backward (like :func:`quant_kernels.cnp.cayley_neumann_lean`);
    backward recomputes ``Q²`` and runs the hand-derived gradient of the module docstring. Not
    twice differentiable.

    Args:
        packed: ``[nb, b(b-1)/2]`` fp32/bf16/fp16 on CUDA (strict upper triangles of ``Q``).
        block_size: ``b ≥ 2``.
        terms: Neumann order; only ``3`` is fused.
        config: the kernels' tiling: ``(tile, num_warps)`` for ``packed``
            (:func:`default_config`), ``(BM, BK, num_warps, num_stages)`` of the ``Q²`` kernel
            for ``hybrid`` (:func:`quant_kernels.cnp_hybrid.default_q2_config`).
        layout: ``hybrid`` (default, faster on the H200): Triton writes ``Q``, ``Q²`` and the
            elementwise terms, cuBLAS runs the full products, chunk by chunk of blocks
            (:mod:`quant_kernels.cnp_hybrid`); ``packed``: every kernel reads ``Q`` from
            ``packed`` (this module).

    Returns:
        ``G`` ``[nb, b, b]`` in ``packed.dtype``; differentiable w.r.t. ``packed``.

    Raises:
        ValueError: ``terms != 3``, an unknown ``layout``, a ``config`` not of that layout, or
            as :func:`cnp_forward`.
    """
    if terms != 3:
        raise ValueError(f"the fused CNP implements k = 3 Neumann terms only, got {terms}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} unknown; use one of {', '.join(LAYOUTS)}")
    _check(packed, block_size)
    if torch.is_grad_enabled() and packed.requires_grad:
        return _CayleyNeumannFused.apply(packed, block_size, config, layout)
    return _forward(packed, block_size, config, layout)
