"""Slab-streamed dequant-GEMM: cuBLAS speed with only a bounded slab of the weight in 16 bits.

The fused kernels in :mod:`quant_kernels.dequant_matmul` decode every weight tile once per
M-tile, which costs ALU time that Hopper's tensor cores do not wait for. At training sizes
(M = 2k–16k tokens) the GEMM is compute-bound, so the other way is cheaper: decode a *slab* of the
weight — a band of rows (forward) or of columns (dX) — into a small reusable buffer with one
memory-bound Triton kernel, and hand that slab to cuBLAS, writing straight into its band of the
output. The full-precision weight never exists: at most ``slab_bytes`` of it at a time (default
:data:`DEFAULT_SLAB_BYTES`, well below the weight's bf16 size at Llama-1B…13B shapes), and a slab
that small is reused from L2.

* forward ``y[M, N] = x[M, K] @ deq(W)[N, K]ᵀ``: row slabs ``W[n0:n1, :]`` → ``y[:, n0:n1]``;
* dX ``dx[M, K] = g[M, N] @ deq(W)``: column slabs ``W[:, k0:k1]`` → ``dx[:, k0:k1]``; every
  output element is one cuBLAS reduction over all of ``N`` (no split accumulation, no extra
  rounding).

Each slab element is decoded exactly as the plain-torch references do (fp32 product, then one
rounding to the activation dtype): int8 row-wise ``CB · (SCB / 127)`` (bitsandbytes
``Int8Params``), 4-bit ``quant_map[code] · absmax[e // blocksize]`` over the row-major flat index
``e`` (bitsandbytes ``Params4bit``, first element of a byte in the high nibble). So results equal
:func:`quant_kernels.reference.int8_rowwise_matmul` / ``reference_4bit.blockwise_4bit_matmul``
up to cuBLAS's own accumulation order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

#: bytes of 16-bit weight decoded per slab (forward rows / dX columns); see the module docstring
DEFAULT_SLAB_BYTES = 32 * 2**20

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: ``(BLOCK_R, BLOCK_C, num_warps)`` of a decode program: rows × columns of the slab it writes
#: (for the 4-bit kernels, columns of the output: 2 per packed byte). The GPU defaults are the
#: fastest in ``evals/bench_slab_decode.py``'s sweep (int8 tiles all within 1 %).
Tile = tuple[int, int, int]
INT8_TILE: Tile = (16, 32, 4) if _INTERPRET else (32, 128, 4)
FOURBIT_TILE: Tile = (16, 32, 4) if _INTERPRET else (4, 512, 2)


@triton.jit
def _int8_slab_kernel(
    cb_ptr, scb_ptr, out_ptr,
    row0, col0, rows, cols, stride_cb,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out[r, c] = CB[row0 + r, col0 + c] · (SCB[row0 + r] / 127) in fp32, rounded to out's
    dtype; the division is IEEE round-to-nearest, as :func:`reference.int8_row_scale`'s."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    src = cb_ptr + (row0 + r).to(tl.int64)[:, None] * stride_cb + (col0 + c)[None, :]
    q = tl.load(src, mask=mask, other=0).to(tl.float32)
    scb = tl.load(scb_ptr + row0 + r, mask=r < rows, other=0.0).to(tl.float32)
    s = tl.math.div_rn(scb, tl.full([BLOCK_R], 127.0, tl.float32))
    dst = out_ptr + r.to(tl.int64)[:, None] * cols + c[None, :]
    tl.store(dst, (q * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _select16(code, qmap_ptr):
    """``quant_map[code]`` for a tile of 4-bit codes by a 4-level tree of selects over the 16
    values held as scalars (no per-element memory gather)."""
    b0, b1 = (code & 1) != 0, (code & 2) != 0
    b2, b3 = (code & 4) != 0, (code & 8) != 0
    q0 = tl.load(qmap_ptr + 0)
    q1 = tl.load(qmap_ptr + 1)
    q2 = tl.load(qmap_ptr + 2)
    q3 = tl.load(qmap_ptr + 3)
    q4 = tl.load(qmap_ptr + 4)
    q5 = tl.load(qmap_ptr + 5)
    q6 = tl.load(qmap_ptr + 6)
    q7 = tl.load(qmap_ptr + 7)
    q8 = tl.load(qmap_ptr + 8)
    q9 = tl.load(qmap_ptr + 9)
    q10 = tl.load(qmap_ptr + 10)
    q11 = tl.load(qmap_ptr + 11)
    q12 = tl.load(qmap_ptr + 12)
    q13 = tl.load(qmap_ptr + 13)
    q14 = tl.load(qmap_ptr + 14)
    q15 = tl.load(qmap_ptr + 15)
    a0 = tl.where(b0, q1, q0)
    a1 = tl.where(b0, q3, q2)
    a2 = tl.where(b0, q5, q4)
    a3 = tl.where(b0, q7, q6)
    a4 = tl.where(b0, q9, q8)
    a5 = tl.where(b0, q11, q10)
    a6 = tl.where(b0, q13, q12)
    a7 = tl.where(b0, q15, q14)
    c0 = tl.where(b1, a1, a0)
    c1 = tl.where(b1, a3, a2)
    c2 = tl.where(b1, a5, a4)
    c3 = tl.where(b1, a7, a6)
    d0 = tl.where(b2, c1, c0)
    d1 = tl.where(b2, c3, c2)
    return tl.where(b3, d1, d0)


@triton.jit
def _nibble_values(byte, qmap_ptr, mask, SELECT_LUT: tl.constexpr):
    """``(quant_map[byte >> 4], quant_map[byte & 15])`` for a tile of packed bytes (int32): by a
    gather load, or with ``SELECT_LUT`` by :func:`_select16`."""
    hi, lo = byte >> 4, byte & 15
    if SELECT_LUT:
        v_hi, v_lo = _select16(hi, qmap_ptr), _select16(lo, qmap_ptr)
    else:
        v_hi = tl.load(qmap_ptr + hi, mask=mask, other=0.0)
        v_lo = tl.load(qmap_ptr + lo, mask=mask, other=0.0)
    return v_hi, v_lo


@triton.jit
def _4bit_slab_kernel(
    packed_ptr, absmax_ptr, qmap_ptr, out_ptr,
    row0, col0, rows, cols, n_cols,
    BLOCKSIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    SELECT_LUT: tl.constexpr,
):  # fmt: skip
    """out[r, c] = quant_map[code(e)] · absmax[e // BLOCKSIZE] with e = (row0+r)·n_cols + col0+c.

    ``SELECT_LUT``: look the code values up by :func:`_select16` instead of a gather load."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    e = (row0 + r).to(tl.int64)[:, None] * n_cols + (col0 + c)[None, :]
    byte = tl.load(packed_ptr + (e >> 1), mask=mask, other=0).to(tl.int32)
    code = tl.where((e & 1) == 0, byte >> 4, byte & 15)
    if SELECT_LUT:
        val = _select16(code, qmap_ptr)
    else:
        val = tl.load(qmap_ptr + code, mask=mask, other=0.0)
    scale = tl.load(absmax_ptr + e // BLOCKSIZE, mask=mask, other=0.0)
    dst = out_ptr + r.to(tl.int64)[:, None] * cols + c[None, :]
    tl.store(dst, (val * scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _4bit_pair_slab_kernel(
    packed_ptr, absmax_ptr, qmap_ptr, out_ptr,
    row0, col0_half, rows, cols, half_cols,
    BLOCKSIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    SELECT_LUT: tl.constexpr,
):  # fmt: skip
    """:func:`_4bit_slab_kernel` a byte at a time, for an even column offset, width and row
    length: each packed byte is loaded once (contiguous along the row) and both nibbles are
    decoded. The two values are interleaved in registers (high nibble first) into one contiguous
    store of ``2·BLOCK_P`` columns."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = (r[:, None] < rows) & (p[None, :] < cols // 2)
    byte_idx = (row0 + r).to(tl.int64)[:, None] * half_cols + (col0_half + p)[None, :]
    byte = tl.load(packed_ptr + byte_idx, mask=mask, other=0).to(tl.int32)
    v_hi, v_lo = _nibble_values(byte, qmap_ptr, mask, SELECT_LUT)
    # both nibbles of a byte share one absmax block (BLOCKSIZE is even): element 2·byte_idx
    scale = tl.load(absmax_ptr + (2 * byte_idx) // BLOCKSIZE, mask=mask, other=0.0)
    val = tl.reshape(tl.join(v_hi * scale, v_lo * scale), [BLOCK_R, 2 * BLOCK_P])
    c = tl.program_id(1) * (2 * BLOCK_P) + tl.arange(0, 2 * BLOCK_P)
    dst = out_ptr + r.to(tl.int64)[:, None] * cols + c[None, :]
    omask = (r[:, None] < rows) & (c[None, :] < cols)
    tl.store(dst, val.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _4bit_block_slab_kernel(
    packed_ptr, absmax_ptr, qmap_ptr, out_ptr,
    row0, col0_half, rows, cols, half_cols,
    BLOCKSIZE: tl.constexpr, BLOCK_R: tl.constexpr, NB: tl.constexpr,
    SELECT_LUT: tl.constexpr,
):  # fmt: skip
    """:func:`_4bit_pair_slab_kernel` for slabs whose rows start on an absmax block (the row
    length and the column offset are multiples of ``BLOCKSIZE``): a program decodes
    ``BLOCK_R`` rows × ``NB`` whole blocks, loading each block's absmax once (``[BLOCK_R, NB]``)
    instead of once per byte."""
    HALF: tl.constexpr = BLOCKSIZE // 2  # bytes per block
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    j = tl.arange(0, HALF)
    rmask = r < rows
    p = blk[:, None] * HALF + j[None, :]  # [NB, HALF] byte column within the slab row
    mask = rmask[:, None, None] & (p < cols // 2)[None, :, :]
    row_byte = (row0 + r).to(tl.int64) * half_cols + col0_half  # [BLOCK_R] first byte of the row
    byte = tl.load(packed_ptr + row_byte[:, None, None] + p[None, :, :], mask=mask, other=0)
    v_hi, v_lo = _nibble_values(byte.to(tl.int32), qmap_ptr, mask, SELECT_LUT)
    bmask = rmask[:, None] & (blk * HALF < cols // 2)[None, :]
    scale = tl.load(absmax_ptr + (2 * row_byte // BLOCKSIZE)[:, None] + blk[None, :], mask=bmask,
                    other=0.0)[:, :, None]  # fmt: skip
    val = tl.reshape(tl.join(v_hi * scale, v_lo * scale), [BLOCK_R, NB * BLOCKSIZE])
    c = tl.program_id(1) * (NB * BLOCKSIZE) + tl.arange(0, NB * BLOCKSIZE)
    dst = out_ptr + r.to(tl.int64)[:, None] * cols + c[None, :]
    omask = rmask[:, None] & (c[None, :] < cols)
    tl.store(dst, val.to(out_ptr.dtype.element_ty), mask=omask)


# A slab decoder fills ``buf`` (contiguous, ``rows·cols`` elements) with W[row0:row0+rows,
# col0:col0+cols] and returns it as a ``[rows, cols]`` view.
_Decoder = Callable[[torch.Tensor, int, int, int, int], torch.Tensor]


def _grid(rows: int, cols: int, block_r: int, block_c: int) -> tuple[int, int]:
    """Programs of a slab decode: ``rows × cols`` in tiles of ``block_r × block_c``."""
    return (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))


def int8_decoder(cb: torch.Tensor, scb: torch.Tensor, *, tile: Tile | None = None) -> _Decoder:
    """Slab decoder for a bitsandbytes int8 row-wise weight (``CB`` int8 ``[N, K]``, ``SCB``
    fp32 ``[N]``). ``tile``: the decode program's ``(BLOCK_R, BLOCK_C, num_warps)``, default
    :data:`INT8_TILE`."""
    br, bc, warps = tile or INT8_TILE

    def decode(buf: torch.Tensor, row0: int, rows: int, col0: int, cols: int) -> torch.Tensor:
        out = buf[: rows * cols]
        _int8_slab_kernel[_grid(rows, cols, br, bc)](
            cb, scb, out, row0, col0, rows, cols, cb.stride(0),
            BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
        )  # fmt: skip
        return out.view(rows, cols)

    return decode


#: decode 4-bit slabs a whole absmax block at a time where they allow it (``fourbit_decoder``):
#: on the H200 a whole Llama-8B / 13B MLP weight in 32 MiB slabs takes 53–75 µs against 72–107
#: µs per byte, int8's 51–65 µs (``evals/results/slab_decode_h200_8b1763c.json``)
FOURBIT_PER_BLOCK = True


def fourbit_decoder(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_map: torch.Tensor,
    blocksize: int,
    k: int,
    *,
    lut: str = "gather",
    tile: Tile | None = None,
    per_block: bool | None = None,
) -> _Decoder:
    """Slab decoder for a bitsandbytes NF4/FP4 weight with ``k`` columns (``absmax`` fp32).

    ``lut``: how code values are looked up: ``"gather"`` (a load from the 16-entry
    ``quant_map`` per element) or ``"select"`` (a tree of selects over 16 scalars); the same
    values either way, ``evals/bench_slab_decode.py`` times them. ``tile``: ``(BLOCK_R,
    BLOCK_C, num_warps)`` of the decode program, default :data:`FOURBIT_TILE`. ``per_block``:
    where the slab's rows start on absmax blocks (``k`` and the column offset multiples of
    ``blocksize``, ``blocksize`` a power of two ≤ ``BLOCK_C``), load each block's absmax once
    instead of once per byte; default :data:`FOURBIT_PER_BLOCK`.

    Raises:
        ValueError: unknown ``lut``.
    """
    if lut not in ("gather", "select"):
        raise ValueError(f"lut must be 'gather' or 'select', got {lut!r}")
    packed, absmax, qmap = packed.reshape(-1), absmax.float().reshape(-1), quant_map.float()
    select = lut == "select"
    br, bc, warps = tile or FOURBIT_TILE
    pow2 = blocksize & (blocksize - 1) == 0
    blockwise = (
        (FOURBIT_PER_BLOCK if per_block is None else per_block) and pow2 and k % blocksize == 0
    )

    def decode(buf: torch.Tensor, row0: int, rows: int, col0: int, cols: int) -> torch.Tensor:
        out = buf[: rows * cols]
        even = col0 % 2 == 0 and cols % 2 == 0
        if blockwise and even and col0 % blocksize == 0 and 2 <= blocksize <= bc:
            nb = bc // blocksize
            _4bit_block_slab_kernel[_grid(rows, cols, br, nb * blocksize)](
                packed, absmax, qmap, out, row0, col0 // 2, rows, cols, k // 2,
                BLOCKSIZE=blocksize, BLOCK_R=br, NB=nb, SELECT_LUT=select, num_warps=warps,
            )  # fmt: skip
        elif k % 2 == 0 and even and blocksize % 2 == 0:
            _4bit_pair_slab_kernel[_grid(rows, cols, br, bc)](
                packed, absmax, qmap, out, row0, col0 // 2, rows, cols, k // 2,
                BLOCKSIZE=blocksize, BLOCK_R=br, BLOCK_P=bc // 2, SELECT_LUT=select,
                num_warps=warps,
            )  # fmt: skip
        else:  # odd offsets / widths: one element at a time
            _4bit_slab_kernel[_grid(rows, cols, br, bc)](
                packed, absmax, qmap, out, row0, col0, rows, cols, k,
                BLOCKSIZE=blocksize, BLOCK_R=br, BLOCK_C=bc, SELECT_LUT=select, num_warps=warps,
            )  # fmt: skip
        return out.view(rows, cols)

    return decode


def _band(total: int, other: int, elem: int, slab_bytes: int, align: int) -> int:
    """Rows (or columns) per slab: a multiple of ``align`` that fits ``slab_bytes`` (at least
    ``align``), balanced so that the bands are about equal (no small last band: each band is one
    cuBLAS call, and a thin one runs the tensor cores at a fraction of their rate)."""
    most = max(slab_bytes // max(other * elem, 1), align) // align * align
    if most >= total:
        return total
    even = -(-total // -(-total // most))  # ceil(total / number of bands)
    return min(-(-even // align) * align, most)


def _prepare(
    act: torch.Tensor, name: str, inner: int, outer: int, n: int, k: int, slab_bytes: int
) -> tuple[torch.Size, torch.Tensor, torch.Tensor]:
    """Checks, then ``(leading shape, act as [rows, inner], empty output [rows, outer])``."""
    if slab_bytes <= 0:
        raise ValueError(f"slab_bytes must be positive, got {slab_bytes}")
    if act.shape[-1] != inner:
        have = act.shape[-1]
        raise ValueError(f"{name} has last dim {have}; the weight [{n}, {k}] needs {inner}")
    act2 = act.reshape(-1, inner)
    return act.shape[:-1], act2, act.new_empty(act2.shape[0], outer)


def streamed_matmul_nt(
    x: torch.Tensor,
    decode: _Decoder,
    n: int,
    k: int,
    *,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
) -> torch.Tensor:
    """``x @ deq(W)ᵀ`` for ``W [n, k]`` given as a slab decoder, one band of rows at a time.

    Args:
        x: ``[..., k]`` floating point (bf16/fp16/fp32; the slab is decoded in ``x.dtype``).
        decode: :func:`int8_decoder` / :func:`fourbit_decoder` of the weight.
        n, k: the weight's shape.
        slab_bytes: size of the reusable decoded slab.

    Returns:
        ``[..., n]`` in ``x.dtype``.

    Raises:
        ValueError: ``x``'s last dim is not ``k`` or ``slab_bytes ≤ 0``.
    """
    lead, x2, y = _prepare(x, "x", k, n, n, k, slab_bytes)
    if y.numel() == 0:
        return y.view(*lead, n)
    band = _band(n, k, x.element_size(), slab_bytes, 128)
    buf = torch.empty(band * k, device=x.device, dtype=x.dtype)
    for n0 in range(0, n, band):
        rows = min(band, n - n0)
        torch.mm(x2, decode(buf, n0, rows, 0, k).t(), out=y[:, n0 : n0 + rows])
    return y.view(*lead, n)


def streamed_matmul_nn(
    g: torch.Tensor,
    decode: _Decoder,
    n: int,
    k: int,
    *,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
) -> torch.Tensor:
    """``g @ deq(W)`` for ``W [n, k]`` (the dX GEMM), one band of columns at a time.

    Args:
        g: ``[..., n]`` floating point.
        decode, n, k, slab_bytes: as in :func:`streamed_matmul_nt`.

    Returns:
        ``[..., k]`` in ``g.dtype``.

    Raises:
        ValueError: ``g``'s last dim is not ``n`` or ``slab_bytes ≤ 0``.
    """
    lead, g2, out = _prepare(g, "g", n, k, n, k, slab_bytes)
    if out.numel() == 0:
        return out.view(*lead, k)
    band = _band(k, n, g.element_size(), slab_bytes, 64)
    buf = torch.empty(band * n, device=g.device, dtype=g.dtype)
    for k0 in range(0, k, band):
        cols = min(band, k - k0)
        torch.mm(g2, decode(buf, 0, n, k0, cols), out=out[:, k0 : k0 + cols])
    return out.view(*lead, k)


def _streamed_fm(
    a: torch.Tensor, decode: _Decoder, n: int, k: int, slab_bytes: int, *, weight_t: bool
) -> torch.Tensor:
    """``deq(W) @ a`` (``weight_t`` False, ``a [k, T]``) or ``deq(W)ᵀ @ a`` (True, ``a [n, T]``):
    one band of output rows per decoded slab (rows of ``W``, or columns for ``Wᵀ``)."""
    if slab_bytes <= 0:
        raise ValueError(f"slab_bytes must be positive, got {slab_bytes}")
    (name, dim, inner), outer = (("dht", "n", n), k) if weight_t else (("zt", "k", k), n)
    if a.dim() != 2 or a.shape[0] != inner:
        raise ValueError(
            f"{name} must be [{dim}, T] with {dim} = {inner} (weight [{n}, {k}]), got "
            f"{tuple(a.shape)}"
        )
    out = a.new_empty(outer, a.shape[1])
    if out.numel() == 0:
        return out
    band = _band(outer, inner, a.element_size(), slab_bytes, 64 if weight_t else 128)
    buf = torch.empty(band * inner, device=a.device, dtype=a.dtype)
    for o0 in range(0, outer, band):
        cnt = min(band, outer - o0)
        slab = decode(buf, 0, n, o0, cnt).t() if weight_t else decode(buf, o0, cnt, 0, k)
        torch.mm(slab, a, out=out[o0 : o0 + cnt])
    return out


def streamed_matmul_fm(
    zt: torch.Tensor, decode: _Decoder, n: int, k: int, *, slab_bytes: int = DEFAULT_SLAB_BYTES
) -> torch.Tensor:
    """``deq(W) @ zt`` for ``W [n, k]`` and a feature-major activation ``zt [k, T]``: the
    forward GEMM ``(z @ Wᵀ)ᵀ`` with its output feature-major too, one band of ``W``'s rows (=
    contiguous rows of the output) at a time.

    Args:
        zt: ``[k, T]`` floating point (the slab is decoded in its dtype).
        decode, n, k, slab_bytes: as in :func:`streamed_matmul_nt`.

    Returns:
        ``[n, T]`` contiguous, ``zt``'s dtype.

    Raises:
        ValueError: ``zt`` is not ``[k, T]`` or ``slab_bytes ≤ 0``.
    """
    return _streamed_fm(zt, decode, n, k, slab_bytes, weight_t=False)


def streamed_matmul_t_fm(
    dht: torch.Tensor, decode: _Decoder, n: int, k: int, *, slab_bytes: int = DEFAULT_SLAB_BYTES
) -> torch.Tensor:
    """``deq(W)ᵀ @ dht`` for ``W [n, k]`` and ``dht [n, T]``: the dX GEMM ``(dh @ W)ᵀ``,
    feature-major in and out, one band of ``W``'s columns (= contiguous output rows) at a time.

    Returns:
        ``[k, T]`` contiguous, ``dht``'s dtype.

    Raises:
        ValueError: ``dht`` is not ``[n, T]`` or ``slab_bytes ≤ 0``.
    """
    return _streamed_fm(dht, decode, n, k, slab_bytes, weight_t=True)


def streamed_backward_fm(
    zt: torch.Tensor,
    dht: torch.Tensor,
    decode: _Decoder,
    n: int,
    k: int,
    *,
    row_align: int,
    on_rows: Callable[[int, torch.Tensor], None],
    slab_bytes: int = DEFAULT_SLAB_BYTES,
) -> torch.Tensor:
    """Both weight GEMMs of a feature-major ``mem`` backward from *one* decode of ``W [n, k]``.

    For each band of rows ``W[r0:r0+c]`` (``c`` a multiple of ``row_align``, the last band
    ragged), one decoded slab serves the recompute ``W[r0:r0+c] @ zt`` (``[c, T]``, handed to
    ``on_rows(r0, rows)`` and then dropped) and the band's share of the dX GEMM,
    ``dzt += W[r0:r0+c]ᵀ @ dht[r0:r0+c]``. :func:`streamed_matmul_fm` followed by
    :func:`streamed_matmul_t_fm` decode the weight twice. The dX GEMM is summed over bands in
    ``dht``'s dtype (one rounding per band in 16-bit).

    Args:
        zt: ``[k, T]`` the forward GEMM's input, feature-major.
        dht: ``[n, T]`` the gradient of the forward GEMM's output, feature-major, same dtype.
        decode, n, k, slab_bytes: as in :func:`streamed_matmul_nt`.
        row_align: band rows are a multiple of it (the layer's output block size ``b``, so each
            band holds whole orthogonal blocks).
        on_rows: called once per band, in order, with the band's first row and its recomputed
            rows of ``W @ zt``.

    Returns:
        ``dzt = Wᵀ @ dht`` ``[k, T]`` contiguous, ``dht``'s dtype.

    Raises:
        ValueError: ``zt`` / ``dht`` of the wrong shape, ``row_align < 1`` or ``slab_bytes ≤ 0``.
    """
    if slab_bytes <= 0:
        raise ValueError(f"slab_bytes must be positive, got {slab_bytes}")
    if row_align < 1:
        raise ValueError(f"row_align must be >= 1, got {row_align}")
    t = zt.shape[-1] if zt.dim() == 2 else -1
    if zt.dim() != 2 or zt.shape[0] != k or tuple(dht.shape) != (n, t):
        raise ValueError(
            f"zt must be [k, T] = [{k}, T] and dht [n, T] = [{n}, T] for the weight [{n}, {k}], "
            f"got {tuple(zt.shape)} and {tuple(dht.shape)}"
        )
    out = dht.new_empty(k, t)
    if out.numel() == 0 or n == 0:
        return out.zero_()
    align = math.lcm(128, row_align)
    band = _band(n, k, zt.element_size(), slab_bytes, align)
    buf = torch.empty(band * k, device=zt.device, dtype=zt.dtype)
    for r0 in range(0, n, band):
        cnt = min(band, n - r0)
        slab = decode(buf, r0, cnt, 0, k)
        on_rows(r0, torch.mm(slab, zt))
        if r0 == 0:
            torch.mm(slab.t(), dht[r0 : r0 + cnt], out=out)
        else:
            out.addmm_(slab.t(), dht[r0 : r0 + cnt])
    return out
