"""Cayley–Neumann forward (``k = 3``) in one persistent Triton kernel, block by block.

:mod:`quant_kernels.cnp_hybrid` makes three passes over memory per chunk of blocks (``Q``;
``Q²`` and ``B``; ``G += Q²·B``), each near its own HBM floor. Here one program takes one
``b×b`` block at a time (a persistent loop over the blocks) and runs all three phases on it,
its ``Q``, ``S = Q²`` (and optionally ``B``) in a per-program scratch that stays in L2 while the
program works on the block; HBM sees ``packed`` once and ``G`` once::

    phase 1   Q = U − Uᵀ            tile pairs (I ≤ J), one coalesced load of U each
    phase 2   S = Q·Q               tile pairs (S is symmetric); with STORE_B also
              B = 2I + 2Q + S
    phase 3   G = I + 2Q + S·B      every tile; B formed per K step in registers without
                                    STORE_B

``tl.debug_barrier()`` separates the phases (the program's threads read what the others
wrote), and scratch is read with ``.cg`` loads (from L2, not a possibly stale L1 line).
Rounding as :mod:`quant_kernels.cnp_hybrid`: fp32 accumulation, ``Q``, ``S`` and ``B`` stored in
the input dtype. The oracle is :func:`quant_kernels.reference.cayley_neumann`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_kernels.cnp_triton import _check, _pairs
from quant_kernels.dequant_matmul import _dot, _interpreting

__all__ = ["BlockConfig", "cnp_forward_block", "default_block_config"]

_UPCAST = _interpreting()

#: ``(BM, BK, num_warps, num_stages, programs per SM, STORE_B)``
BlockConfig = tuple[int, int, int, int, int, bool]


@triton.jit
def _scratch_tile(base, r0, c0, b, BR: tl.constexpr, BC: tl.constexpr):
    r = r0 + tl.arange(0, BR)[:, None]
    c = c0 + tl.arange(0, BC)[None, :]
    return tl.load(base + r * b + c, mask=(r < b) & (c < b), other=0.0, cache_modifier=".cg")


@triton.jit
def _put(base, val, r0, c0, b, BR: tl.constexpr, BC: tl.constexpr):
    r = r0 + tl.arange(0, BR)[:, None]
    c = c0 + tl.arange(0, BC)[None, :]
    tl.store(base + r * b + c, val.to(base.dtype.element_ty), mask=(r < b) & (c < b))


@triton.jit
def _eye(x, r0, c0, alpha, BR: tl.constexpr, BC: tl.constexpr):
    r = r0 + tl.arange(0, BR)[:, None]
    c = c0 + tl.arange(0, BC)[None, :]
    return tl.where(r == c, x + alpha, x)


@triton.jit
def _cnp_fwd_block_kernel(
    packed_ptr, scratch_ptr, g_ptr, pairs_ptr, b, npk, nb, n_pairs, n_tiles,
    STORE_B: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    bb = b * b
    qs = scratch_ptr + pid.to(tl.int64) * (3 * bb)
    ss = qs + bb
    bs = ss + bb
    dt = scratch_ptr.dtype.element_ty
    for blk in range(pid, nb, nprog):
        pk = packed_ptr + tl.cast(blk, tl.int64) * npk
        for p in range(n_pairs):  # phase 1: Q
            ti = tl.load(pairs_ptr + p)
            tj = tl.load(pairs_ptr + n_pairs + p)
            r = ti * BM + tl.arange(0, BM)[:, None]
            c = tj * BM + tl.arange(0, BM)[None, :]
            row_off = r * b - ((r * (r + 1)) >> 1) - r - 1
            u = tl.load(pk + row_off + c, mask=(r < c) & (c < b), other=0.0).to(tl.float32)
            if ti == tj:
                _put(qs, u - tl.trans(u), ti * BM, tj * BM, b, BM, BM)
            else:
                _put(qs, u, ti * BM, tj * BM, b, BM, BM)
                _put(qs, -tl.trans(u), tj * BM, ti * BM, b, BM, BM)
        tl.debug_barrier()
        for p in range(n_pairs):  # phase 2: S = Q·Q (and B)
            ti = tl.load(pairs_ptr + p)
            tj = tl.load(pairs_ptr + n_pairs + p)
            r0 = ti * BM
            c0 = tj * BM
            acc = tl.zeros((BM, BM), dtype=tl.float32)
            for k0 in range(0, b, BK):
                a = _scratch_tile(qs, r0, k0, b, BM, BK)
                bt = _scratch_tile(qs, k0, c0, b, BK, BM)
                acc = _dot(a, bt, acc, UPCAST, IEEE)
            val = acc.to(dt)
            _put(ss, val, r0, c0, b, BM, BM)
            if ti != tj:
                _put(ss, tl.trans(val), c0, r0, b, BM, BM)
            if STORE_B:
                sv = val.to(tl.float32)
                q2 = 2.0 * _scratch_tile(qs, r0, c0, b, BM, BM).to(tl.float32)
                _put(bs, _eye(sv + q2, r0, c0, 2.0, BM, BM), r0, c0, b, BM, BM)
                if ti != tj:
                    _put(bs, tl.trans(sv - q2), c0, r0, b, BM, BM)
        tl.debug_barrier()
        gb = g_ptr + tl.cast(blk, tl.int64) * bb
        for t in range(n_tiles * n_tiles):  # phase 3: G = I + 2Q + S·B
            r0 = (t // n_tiles) * BM
            c0 = (t % n_tiles) * BM
            acc = tl.zeros((BM, BM), dtype=tl.float32)
            for k0 in range(0, b, BK):
                a = _scratch_tile(ss, r0, k0, b, BM, BK)
                if STORE_B:
                    bkj = _scratch_tile(bs, k0, c0, b, BK, BM)
                else:
                    f = 2.0 * _scratch_tile(qs, k0, c0, b, BK, BM).to(tl.float32)
                    f += _scratch_tile(ss, k0, c0, b, BK, BM).to(tl.float32)
                    bkj = _eye(f, k0, c0, 2.0, BK, BM).to(dt)
                acc = _dot(a, bkj, acc, UPCAST, IEEE)
            acc += 2.0 * _scratch_tile(qs, r0, c0, b, BM, BM).to(tl.float32)
            _put(gb, _eye(acc, r0, c0, 1.0, BM, BM), r0, c0, b, BM, BM)
        tl.debug_barrier()  # the next block overwrites this program's scratch


def default_block_config(block_size: int, dtype: torch.dtype) -> BlockConfig:
    """``(BM, BK, num_warps, num_stages, programs per SM, STORE_B)`` for ``b`` and ``dtype``:
    64×64 tiles, 64-wide K steps, 4 warps, 3 stages, one program per SM, ``B`` stored (16-bit,
    ``b ≥ 64``); 32×32 / 32 for fp32; 16×16 / 16 under ``TRITON_INTERPRET=1``."""
    if _UPCAST:
        return 16, 16, 4, 1, 1, True
    if dtype != torch.float32 and block_size >= 64:
        return 64, 64, 4, 3, 1, True
    return 32, 32, 4, 2, 1, True


def cnp_forward_block(
    packed: torch.Tensor,
    block_size: int,
    *,
    config: BlockConfig | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """``G = I + 2Q + 2Q² + 2Q³ + Q⁴`` per block (CNP, ``k = 3``) in one persistent kernel.

    Same contract as :func:`quant_kernels.cnp_triton.cnp_forward`; transient memory a scratch of
    ``3·b²`` elements per program (``programs`` of them: default programs-per-SM × SMs on CUDA,
    4 under the interpreter).

    Raises:
        ValueError: as :func:`quant_kernels.cnp_triton.cnp_forward`.
    """
    _check(packed, block_size)
    b, nb = block_size, packed.shape[0]
    packed = packed.contiguous()
    bm, bk, warps, stages, per_sm, store_b = config or default_block_config(b, packed.dtype)
    g = torch.empty(nb, b, b, dtype=packed.dtype, device=packed.device)
    if nb == 0:
        return g
    if programs is None:
        sms = (
            torch.cuda.get_device_properties(packed.device).multi_processor_count
            if packed.is_cuda
            else 4
        )
        programs = sms * per_sm
    programs = max(1, min(nb, programs))
    n_tiles = triton.cdiv(b, bm)
    pairs = _pairs(n_tiles, packed.device)
    n_pairs = pairs.shape[1]
    scratch = packed.new_empty(programs, 3, b, b)
    _cnp_fwd_block_kernel[(programs,)](
        packed, scratch, g, pairs, b, packed.shape[1], nb, n_pairs, n_tiles,
        STORE_B=store_b, UPCAST=_UPCAST, IEEE=packed.dtype == torch.float32, BM=bm, BK=bk,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return g
