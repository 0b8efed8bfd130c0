"""Fused Cayley–Neumann blocks (CNP, ``k = 3``), forward and hand-derived backward: Triton for
what needs index math or elementwise terms, cuBLAS for the full ``b×b`` products, chunk by chunk.

CNP (POET, arXiv 2506.08001): each ``b×b`` orthogonal block is ``G = (I + Q)(I + Q + Q² + Q³)``
with ``Q = U − Uᵀ`` skew-symmetric, ``U`` the strict upper triangle stored row-major
(``torch.triu_indices(b, b, 1)`` order) in ``packed [nb, b(b-1)/2]``:
``U[i, j] = packed[i·b − i(i+1)/2 + (j − i − 1)]`` (i < j). With ``S = Q²`` and
``B = 2I + 2Q + S``::

    forward:   G = I + 2Q + S·B                         = I + 2Q + 2Q² + 2Q³ + Q⁴

Backward, derived by hand. Let ``M = ∂L/∂G``. Reverse mode through ``G = I + 2Q + S·B``,
``B = 2I + 2Q + S`` and ``S = Q·Q``, using ``Qᵀ = −Q`` and ``Sᵀ = S`` (so ``Bᵀ = 2I − 2Q + S``)::

    ∂S = M·Bᵀ + S·M =: E,    ∂Q = 2M + 2·S·M − (E·Q + Q·E)

``Q = U − Uᵀ`` gives ``∂U[i, j] = ∂Q[i, j] − ∂Q[j, i]`` (i < j). With ``N = S·M``,
``D = E + Eᵀ`` (symmetric) and ``DQ + QD = DQ − (DQ)ᵀ`` (``D`` symmetric, ``Q`` skew)::

    backward:  N = S·M,  E = M·Bᵀ + N,  D = E + Eᵀ,  Y = 2M + 2N − D·Q
               d_packed = strict upper triangle of Y − Yᵀ

At ``b = 256`` a ``b×b×b`` product does 87 FLOP per byte of its operands and result, below the
H200's ridge point (~200 FLOP/B): each product is bound by memory traffic, and cuBLAS's batched
GEMM runs them at ~300 TFLOP/s, close to that bound (an all-Triton layout that read ``Q`` tiles
straight from the packed triangle ran at ~100 TFLOP/s and was removed; ``docs/KERNELS.md``). So:

- Triton writes what needs index math or elementwise terms, each tile pair ``(I ≤ J)`` of a
  block from one coalesced load: ``Q`` (and ``G₀ = I + 2Q`` in forward) from ``packed``;
  ``S = Q·Q`` on the tile pairs (``S`` is symmetric) together with ``B`` or ``Bᵀ``;
  ``D = (E' + N) + (E' + N)ᵀ`` in place; the fold of ``Y`` into ``d_packed``.
- cuBLAS runs the full products (``bmm`` / ``baddbmm_`` in place): ``G += S·B`` in forward,
  ``N = S·M``, ``E' = M·Bᵀ`` and ``Y' = 2N − D·Q`` in backward.
- The blocks go in chunks of :data:`CHUNK_BYTES` per buffer, so the transients are a few such
  buffers whatever the model size.

Rounding: products accumulate in fp32 and every intermediate (``Q``, ``S``, ``B``, ``N``,
``E'``, ``D``, ``Y'``) is stored in the input dtype, as autograd of the torch reference stores
its intermediates. :func:`cayley_neumann_fused` wraps both directions in an autograd Function
that saves only ``packed`` (like the torch path of :func:`quant_kernels.cnp.cayley_neumann`).
The oracle is :func:`quant_kernels.reference.cayley_neumann` (float64 in the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_kernels.dequant_matmul import _dot, _interpreting

__all__ = [
    "CHUNK_BYTES", "Q2Config", "cayley_neumann_fused", "cnp_backward_hybrid",
    "cnp_forward_hybrid", "default_q2_config",
]  # fmt: skip

_UPCAST = _interpreting()
#: dtypes of ``packed`` the kernels accept (fp32 accumulation in all of them)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


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
def _block_and_pair(pairs_ptr, n_pairs):
    """(block, I, J) of this program: programs run over blocks × tile pairs ``I ≤ J``."""
    pid = tl.program_id(0)
    p = pid % n_pairs
    return (pid // n_pairs).to(tl.int64), tl.load(pairs_ptr + p), tl.load(pairs_ptr + n_pairs + p)


@triton.jit
def _store_tile(base, val, r0, c0, b, BR: tl.constexpr, BC: tl.constexpr):
    r = r0 + tl.arange(0, BR)[:, None]
    c = c0 + tl.arange(0, BC)[None, :]
    tl.store(base + r * b + c, val.to(base.dtype.element_ty), mask=(r < b) & (c < b))


@triton.jit
def _q2_aux_kernel(
    q_ptr, s_ptr, aux_ptr, pairs_ptr, b, n_pairs, alpha_i, beta_q,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """``S = Q·Q`` on tile pair ``(I ≤ J)`` (tile ``(J, I)`` is the transpose) and
    ``AUX = alpha_i·I + beta_q·Q + S`` on both tiles (``S`` as stored, rounded)."""
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
def _sym_pairs_kernel(e_ptr, n_ptr, pairs_ptr, b, n_pairs, BM: tl.constexpr):
    """In place on tile pair ``(I ≤ J)``: ``E ← D = (E + N) + (E + N)ᵀ`` (symmetric)."""
    blk, ti, tj = _block_and_pair(pairs_ptr, n_pairs)
    eb = e_ptr + blk * b * b
    nb_ = n_ptr + blk * b * b
    r0, c0 = ti * BM, tj * BM
    x_ij = _tile(eb, r0, c0, b, BM, BM).to(tl.float32) + _tile(nb_, r0, c0, b, BM, BM)
    x_ji = _tile(eb, c0, r0, b, BM, BM).to(tl.float32) + _tile(nb_, c0, r0, b, BM, BM)
    d = x_ij + tl.trans(x_ji)
    _store_tile(eb, d, r0, c0, b, BM, BM)
    if ti != tj:
        _store_tile(eb, tl.trans(d), c0, r0, b, BM, BM)


@triton.jit
def _fold_pairs_kernel(
    y_ptr, m_ptr, dp_ptr, pairs_ptr, b, npk, n_pairs, alpha, BM: tl.constexpr
):  # fmt: skip
    """``d_packed`` entries of tile pair ``(I ≤ J)``: the strict upper triangle of
    ``X − Xᵀ`` with ``X = Y + alpha·M``, both tiles read row by row (coalesced)."""
    blk, ti, tj = _block_and_pair(pairs_ptr, n_pairs)
    yb = y_ptr + blk * b * b
    mb = m_ptr + blk * b * b
    r0, c0 = ti * BM, tj * BM
    x_ij = _tile(yb, r0, c0, b, BM, BM).to(tl.float32)
    x_ij += alpha * _tile(mb, r0, c0, b, BM, BM).to(tl.float32)
    x_ji = _tile(yb, c0, r0, b, BM, BM).to(tl.float32)
    x_ji += alpha * _tile(mb, c0, r0, b, BM, BM).to(tl.float32)
    a = x_ij - tl.trans(x_ji)
    r = r0 + tl.arange(0, BM)[:, None]
    c = c0 + tl.arange(0, BM)[None, :]
    idx = r * b - ((r * (r + 1)) >> 1) + (c - r - 1)
    tl.store(dp_ptr + blk * npk + idx, a.to(dp_ptr.dtype.element_ty), mask=(r < c) & (c < b))


# ----------------------------------------------------------------------------------------------
# host launchers
# ----------------------------------------------------------------------------------------------
# host launchers
# ----------------------------------------------------------------------------------------------


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
    contiguous, ``d_g`` in ``packed.dtype``.

    Raises:
        ValueError: as :func:`_check`, or ``d_g`` of the wrong shape.
    """
    _check(packed, block_size)
    nb, b = packed.shape[0], block_size
    if d_g.shape != (nb, b, b):
        raise ValueError(f"d_g must be [{nb}, {b}, {b}], got {tuple(d_g.shape)}")
    return packed.contiguous(), d_g.to(packed.dtype).contiguous()


#: ``(BM, BK, num_warps, num_stages)``: square ``BM×BM`` output tiles, ``BK``-wide K steps
Q2Config = tuple[int, int, int, int]


def default_q2_config(block_size: int, dtype: torch.dtype) -> Q2Config:
    """``(BM, BK, num_warps, num_stages)`` of the ``S = Q·Q`` kernel for ``b = block_size`` and
    ``dtype``.

    16-bit: 64×64 tiles, 64-wide K steps, 4 warps, 3 stages for ``b ≥ 64`` (over the Llama-8B
    blocks at b = 256 the fastest of seven, ``evals/results/cnp_hybrid_v1_h200.json``); fp32
    (full-precision FMA products): 32×32 tiles, 32-wide steps. Smaller ``b`` use one tile of
    ``next_power_of_2(b)``. Under ``TRITON_INTERPRET=1``: 16×16 tiles and 16-wide steps, so the
    CPU tests' small ``b`` run several K steps and partial tiles. ``evals/bench_cnp.py --sweep``
    times alternatives.
    """
    if _UPCAST:
        return 16, 16, 4, 1
    if dtype != torch.float32 and block_size >= 64:
        return 64, 64, 4, 3
    cap = 32 if dtype == torch.float32 else 64
    bm = min(cap, max(16, triton.next_power_of_2(block_size)))
    return bm, min(bm, 64 if dtype != torch.float32 else 32), 4, 2


def _meta(packed: torch.Tensor, b: int, config: Q2Config | None) -> tuple[int, dict]:
    if config is not None and len(config) != 4:
        raise ValueError(
            f"config {tuple(config)}: the fused CNP takes (BM, BK, num_warps, num_stages)"
        )
    bm, bk, warps, stages = config or default_q2_config(b, packed.dtype)
    if (
        bm not in (16, 32, 64, 128) or bk not in (16, 32, 64, 128) or warps not in (1, 2, 4, 8)
        or type(stages) is not int or stages < 1
    ):  # fmt: skip
        raise ValueError(
            f"hybrid CNP config (BM, BK, warps, stages) = {(bm, bk, warps, stages)}: BM and BK "
            "16/32/64/128, warps 1/2/4/8, stages an int >= 1"
        )
    meta = {
        "UPCAST": _UPCAST, "IEEE": packed.dtype == torch.float32, "BM": bm, "BK": bk,
        "num_warps": warps, "num_stages": stages,
    }  # fmt: skip
    return triton.cdiv(b, bm), meta


#: bytes of one transient ``[chunk, b, b]`` buffer: the blocks go through in chunks of
#: ``CHUNK_BYTES // (b²·element size)`` (2,048 blocks of b = 256 in bf16)
CHUNK_BYTES = 256 * 2**20
_SKEW_BM = 16 if _UPCAST else 64


def _chunks(nb: int, b: int, elt: int, chunk_bytes: int) -> int:
    """Blocks per chunk: as many ``b×b`` matrices of ``elt`` bytes as fit ``chunk_bytes``, at
    least one, at most ``nb``.

    Raises:
        ValueError: ``chunk_bytes`` is not a positive int.
    """
    if type(chunk_bytes) is not int or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int (bytes), got {chunk_bytes!r}")
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
    _q2_aux_kernel[(q.shape[0] * n_pairs,)](q, s, aux, pairs, b, n_pairs, alpha_i, beta_q, **meta)


def cnp_forward_hybrid(
    packed: torch.Tensor,
    block_size: int,
    *,
    config: Q2Config | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """``G = I + 2Q + S·B`` (``S = Q²``, ``B = 2I + 2Q + S``; CNP with ``k = 3``), chunk by
    chunk of blocks: one Triton pass writes ``Q`` and ``G₀ = I + 2Q``, one writes ``S`` (upper
    tile pairs) and ``B``, and cuBLAS adds ``S·B`` into ``G`` (``baddbmm_``).

    No autograd; transient memory three buffers of ``chunk_bytes`` (``Q``, ``S``, ``B``)
    whatever the number of blocks.

    Args:
        packed: ``[nb, b(b-1)/2]`` fp32/bf16/fp16 on CUDA (strict upper triangles of ``Q``).
        block_size: ``b ≥ 2``.
        config: ``(BM, BK, num_warps, num_stages)`` of the ``S`` kernel; default
            :func:`default_q2_config`.
        chunk_bytes: bytes of one ``[chunk, b, b]`` buffer (a chunk holds at least one block,
            so a buffer is at least ``b²`` elements).

    Returns:
        ``G`` ``[nb, b, b]`` in ``packed.dtype``.

    Raises:
        ValueError: wrong width for ``b``, ``b < 2``, an unsupported dtype, not a CUDA tensor
            (outside the Triton interpreter), a bad ``config`` or ``chunk_bytes``.
    """
    _check(packed, block_size)
    b, nb = block_size, packed.shape[0]
    packed = packed.contiguous()
    n_tiles, meta = _meta(packed, b, config)
    g = torch.empty(nb, b, b, dtype=packed.dtype, device=packed.device)
    chunk = _chunks(nb, b, packed.element_size(), chunk_bytes)
    with torch.autocast(packed.device.type, enabled=False):  # the products run in packed.dtype
        _forward_chunks(packed, g, b, n_tiles, meta, chunk)
    return g


def _forward_chunks(packed, g, b, n_tiles, meta, chunk) -> None:
    nb = packed.shape[0]
    q = s = aux = None
    for c0 in range(0, nb, chunk):
        c1 = min(nb, c0 + chunk)
        if q is None or q.shape[0] != c1 - c0:
            q, s, aux = (packed.new_empty(c1 - c0, b, b) for _ in range(3))
        _skew_pairs(packed[c0:c1], q, g[c0:c1], b)
        _q2_aux(q, s, aux, b, n_tiles, meta, 2.0, 2.0)
        g[c0:c1].baddbmm_(s, aux)


def cnp_backward_hybrid(
    packed: torch.Tensor,
    d_g: torch.Tensor,
    block_size: int,
    *,
    config: Q2Config | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """Gradient of ``⟨d_g, CNP(packed)⟩`` w.r.t. ``packed``, chunk by chunk of blocks.

    With ``M = d_g`` and the module docstring's ``S``, ``B``, ``N``, ``E``, ``D`` and ``Y``,
    the packed gradient is the strict upper triangle of ``Y − Yᵀ``. Per chunk: Triton writes
    ``Q`` (one coalesced load of ``U`` per tile pair), ``S`` and ``C = Bᵀ = 2I − 2Q + S``; cuBLAS
    runs ``N = S·M`` and ``E' = M·C``; Triton symmetrizes ``D = (E' + N) + (E' + N)ᵀ`` in
    place; cuBLAS runs ``Y' = 2N − D·Q`` in place; Triton folds ``Y' + 2M`` into
    ``d_packed``. Three full ``b×b`` products (plus ``S`` on tile pairs), against four for
    autograd of the reference.

    Transient memory five buffers of ``chunk_bytes``.

    Args:
        packed: ``[nb, b(b-1)/2]`` fp32/bf16/fp16 on CUDA (strict upper triangles of ``Q``).
        d_g: ``[nb, b, b]`` gradient of ``G`` (cast to ``packed.dtype``).
        block_size: ``b ≥ 2``.
        config: ``(BM, BK, num_warps, num_stages)`` of the ``S`` kernel; default
            :func:`default_q2_config`.
        chunk_bytes: bytes of one ``[chunk, b, b]`` buffer (at least one block per chunk).

    Returns:
        ``d_packed`` ``[nb, b(b-1)/2]`` in ``packed.dtype``.

    Raises:
        ValueError: as :func:`cnp_forward_hybrid`, or ``d_g`` of the wrong shape.
    """
    packed, d_g = _backward_inputs(packed, d_g, block_size)
    b, nb = block_size, packed.shape[0]
    n_tiles, meta = _meta(packed, b, config)
    d_packed = torch.empty_like(packed)
    chunk = _chunks(nb, b, packed.element_size(), chunk_bytes)
    with torch.autocast(packed.device.type, enabled=False):  # the products run in packed.dtype
        _backward_chunks(packed, d_g, d_packed, b, n_tiles, meta, chunk)
    return d_packed


def _backward_chunks(packed, d_g, d_packed, b, n_tiles, meta, chunk) -> None:
    nb, npk = packed.shape
    pairs = _pairs(triton.cdiv(b, _SKEW_BM), packed.device)
    n_pairs = pairs.shape[1]
    q = s = c = n = e = None
    for c0 in range(0, nb, chunk):
        c1 = min(nb, c0 + chunk)
        if q is None or q.shape[0] != c1 - c0:
            q, s, c, n, e = (packed.new_empty(c1 - c0, b, b) for _ in range(5))
        m = d_g[c0:c1]
        _skew_pairs(packed[c0:c1], q, None, b)
        _q2_aux(q, s, c, b, n_tiles, meta, 2.0, -2.0)  # S; C = Bᵀ = 2I − 2Q + S
        torch.bmm(s, m, out=n)  # N = S·M
        torch.bmm(m, c, out=e)  # E' = M·Bᵀ
        grid = ((c1 - c0) * n_pairs,)
        _sym_pairs_kernel[grid](e, n, pairs, b, n_pairs, BM=_SKEW_BM)  # e ← D
        n.baddbmm_(e, q, beta=2.0, alpha=-1.0)  # n ← Y' = 2N − D·Q
        _fold_pairs_kernel[grid](n, m, d_packed[c0:c1], pairs, b, npk, n_pairs, 2.0, BM=_SKEW_BM)


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------


class _CayleyNeumannFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, packed: torch.Tensor, block_size: int, config) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(packed)
        ctx.block_size, ctx.config = block_size, config
        return cnp_forward_hybrid(packed, block_size, config=config)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_g: torch.Tensor):  # type: ignore[override]
        (packed,) = ctx.saved_tensors
        return cnp_backward_hybrid(packed, d_g, ctx.block_size, config=ctx.config), None, None


def cayley_neumann_fused(
    packed: torch.Tensor, block_size: int, terms: int = 3, *, config: Q2Config | None = None
) -> torch.Tensor:
    """Fused :func:`~quant_kernels.reference.cayley_neumann` for ``k = 3`` (POET,
    arXiv 2506.08001): ``G = I + 2(Q + Q² + Q³) + Q⁴`` with ``Q = U − Uᵀ``.

    Saves only ``packed`` for backward (like the torch path of
    :func:`quant_kernels.cnp.cayley_neumann`); backward recomputes ``S = Q²`` and runs the
    hand-derived gradient of the module docstring. Not twice differentiable.

    Args:
        packed: ``[nb, b(b-1)/2]`` fp32/bf16/fp16 on CUDA (strict upper triangles of ``Q``).
        block_size: ``b ≥ 2``.
        terms: Neumann order; only ``3`` is fused.
        config: ``(BM, BK, num_warps, num_stages)`` of the ``S`` kernel; default
            :func:`default_q2_config`.

    Returns:
        ``G`` ``[nb, b, b]`` in ``packed.dtype``; differentiable w.r.t. ``packed``.

    Raises:
        ValueError: ``terms != 3``, or as :func:`cnp_forward_hybrid`.
    """
    if terms != 3:
        raise ValueError(f"the fused CNP implements k = 3 Neumann terms only, got {terms}")
    _check(packed, block_size)
    if torch.is_grad_enabled() and packed.requires_grad:
        return _CayleyNeumannFused.apply(packed, block_size, config)
    return cnp_forward_hybrid(packed, block_size, config=config)
